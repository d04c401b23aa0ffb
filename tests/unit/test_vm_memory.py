"""A VM's memory settings: TCG's code cache is bounded on the QEMU command
line as configured, and the setting is refused by name outside its range."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from corral.config import NodeConfig
from corral.errors import InvalidArgument
from corral.runtimes.vm.qemu import MicroVM


def _accel(monkeypatch: Any, **kw: Any) -> str:
    monkeypatch.setattr("corral.runtimes.vm.qemu.qemu_binary", lambda: "qemu")
    p = Path("/x")
    argv = MicroVM(kernel=p, initrd=p, agent_socket=p, console_log=p, qmp_socket=p, **kw).argv()
    return argv[argv.index("-accel") + 1]


def test_the_tcg_code_cache_is_bounded_as_configured(monkeypatch: Any) -> None:
    assert _accel(monkeypatch, accel="tcg", tb_mib=64) == "tcg,tb-size=64"
    assert _accel(monkeypatch, accel="tcg", tb_mib=0) == "tcg"  # QEMU's own default
    assert _accel(monkeypatch, accel="kvm", tb_mib=64) == "kvm"  # no code cache under KVM


def test_the_default_bounds_it_and_the_environment_sets_it(monkeypatch: Any) -> None:
    assert NodeConfig().vm_tcg_cache_mib == 64
    monkeypatch.setenv("CORRAL_VM_TCG_CACHE_MIB", "128")
    assert NodeConfig.from_env().vm_tcg_cache_mib == 128


@pytest.mark.parametrize("value", [-1, 1, 7, 4097, 1 << 20])
def test_a_code_cache_size_outside_its_range_is_refused(value: int) -> None:
    with pytest.raises(InvalidArgument) as exc:
        NodeConfig(vm_tcg_cache_mib=value)
    assert exc.value.field == "vm_tcg_cache_mib"
    assert "8 to 4096" in exc.value.rule and exc.value.value == value
