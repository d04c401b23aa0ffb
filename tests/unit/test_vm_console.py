"""A VM's console log is the guest's to write: what the host reads of it
for a failure's report is its tail, however large it has grown."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from corral.runtimes.vm import runtime as vm

pytestmark = pytest.mark.unit


def test_the_console_tail_reads_only_the_end(tmp_path: Path) -> None:
    log = tmp_path / "console.log"
    with open(log, "wb") as f:  # 64 GiB of a line never ended (sparse), then a last line
        f.seek(64 << 30)
        f.write(b"\nkernel panic: the last words\n")
    fake = SimpleNamespace(_dir=lambda sandbox_id: tmp_path)
    tail = vm.MicroVMRuntime.console_tail(fake, "s", lines=1)  # type: ignore[arg-type]
    assert tail == "kernel panic: the last words"
