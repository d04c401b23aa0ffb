"""A fork copy's connections out are aborted by the host's corral-netmove
before its interface exists (node/network.py). One that never ends fails
the copy's create at NETMOVE_TIMEOUT, is killed and reaped, and says so;
one that fails says why. By injection: the helper is a script here."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from corral.errors import SandboxFailed
from corral.node import network

pytestmark = pytest.mark.unit


def _networks(helper: Path) -> network.SandboxNetworks:
    # Only the helper is used on this path.
    return network.SandboxNetworks(None, None, None, None, helper)  # type: ignore[arg-type]


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "corral-netmove"
    path.write_text(f"#!/bin/sh\necho $$ > {tmp_path}/pid\n{body}\n")
    path.chmod(0o755)
    return path


async def test_a_netmove_that_never_ends_fails_the_copy_and_is_reaped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(network, "NETMOVE_TIMEOUT", 0.5)
    nets = _networks(_script(tmp_path, "exec sleep 600"))
    t0 = time.monotonic()
    with pytest.raises(SandboxFailed, match=r"did not end its copied connections within 0.5 s"):
        await nets._abort_outside("n0-" + "a" * 16, ["--netns-of", "1"])
    assert time.monotonic() - t0 < 10
    pid = int((tmp_path / "pid").read_text())
    with pytest.raises(ProcessLookupError):  # killed, and reaped: not even a zombie
        os.kill(pid, 0)


async def test_a_netmove_that_fails_says_why(tmp_path: Path) -> None:
    nets = _networks(_script(tmp_path, "echo 'setns: Operation not permitted' >&2; exit 1"))
    with pytest.raises(SandboxFailed, match="could not be ended: setns: Operation not permitted"):
        await nets._abort_outside("n0-" + "a" * 16, ["--netns-of", "1"])
