"""host/sealed.py: the OCI runtime's binary as a sealed memfd, made once."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from corral.host import sealed

pytestmark = pytest.mark.unit

TRUE = shutil.which("true") or "/bin/true"


def test_the_copy_is_the_binary_sealed_as_crun_and_runc_require() -> None:
    fd = sealed.sealed_copy(TRUE)
    assert fd is not None
    try:
        # Exactly the four seals: crun's is_self_cloned() compares for equality.
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) == sealed.SEALS
        assert os.pread(fd, 1 << 22, 0) == Path(TRUE).read_bytes()
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"\x7fELF", 0)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 1)
        # Not handed to the programs the agent starts unless passed.
        assert not os.get_inheritable(fd)
        # And it runs.
        done = subprocess.run([f"/proc/self/fd/{fd}"], pass_fds=[fd], timeout=10)
        assert done.returncode == 0
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    ("sysctl", "made"),
    [("0\n", True), ("1\n", True), ("2\n", False), ("", True)],
    ids=["memfd-exec-allowed", "noexec-by-default-asks-MFD_EXEC", "exec-refused", "unreadable"],
)
def test_memfd_noexec_decides(
    sysctl: str, made: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    knob = tmp_path / "memfd_noexec"
    if sysctl:
        knob.write_text(sysctl)
    # A kernel before 6.3 has no such knob and refuses MFD_EXEC.
    knows_mfd_exec = Path("/proc/sys/vm/memfd_noexec").exists()
    monkeypatch.setattr(sealed, "_NOEXEC_SYSCTL", knob)
    fd = sealed.sealed_copy(TRUE)
    assert (fd is not None) == (made and (knows_mfd_exec or sysctl != "1\n"))
    if fd is not None:
        os.close(fd)


def test_a_missing_binary_gives_none_not_an_error(tmp_path: Path) -> None:
    assert sealed.sealed_copy(str(tmp_path / "no-such-crun")) is None
