"""A VM's memory and idle settings: TCG's code cache is bounded on the QEMU
command line as configured, and the setting is refused by name outside its
range; an idle microVM has no PIT ticking and a guest kernel told to keep
its periodic timers off."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from corral.config import NodeConfig
from corral.errors import InvalidArgument
from corral.runtimes.vm.qemu import MicroVM


def _argv(monkeypatch: Any, **kw: Any) -> list[str]:
    monkeypatch.setattr("corral.runtimes.vm.qemu.qemu_binary", lambda: "qemu")
    p = Path("/x")
    return MicroVM(kernel=p, initrd=p, agent_socket=p, console_log=p, qmp_socket=p, **kw).argv()


def _accel(monkeypatch: Any, **kw: Any) -> str:
    argv = _argv(monkeypatch, **kw)
    return argv[argv.index("-accel") + 1]


def _opt(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_an_idle_microvm_under_tcg_has_no_pit_and_a_quiet_guest_kernel(monkeypatch: Any) -> None:
    tcg = _argv(monkeypatch, accel="tcg")
    assert _opt(tcg, "-M").split(",")[0] == "microvm" and "pit=off" in _opt(tcg, "-M").split(",")
    append = _opt(tcg, "-append").split()
    for word in ("nowatchdog", "psi=0", "tsc=reliable", "tsc_early_khz=2000000"):
        assert word in append
    kvm = _argv(monkeypatch, accel="kvm")
    assert "pit=off" not in _opt(kvm, "-M")  # KVM's in-kernel PIT: untried, left
    assert "nowatchdog" in _opt(kvm, "-append").split()
    assert "tsc=reliable" not in _opt(kvm, "-append").split()
    assert "sysctl.vm.stat_interval=60" in append
    assert "sysctl.vm.compaction_proactiveness=0" in append
    full = _argv(monkeypatch, accel="tcg", display=(800, 600))
    assert _opt(full, "-M") == "q35"  # its firmware-era devices stay
    assert "nowatchdog" in _opt(full, "-append").split()


def test_quiet_idle_off_is_qemus_and_the_kernels_defaults(monkeypatch: Any) -> None:
    argv = _argv(monkeypatch, accel="tcg", quiet_idle=False)
    assert "pit=off" not in _opt(argv, "-M")
    append = _opt(argv, "-append")
    assert not any(w in append for w in ("nowatchdog", "psi=0", "sysctl."))
    assert "  " not in append
    assert NodeConfig().vm_quiet_idle
    monkeypatch.setenv("CORRAL_VM_QUIET_IDLE", "0")
    assert not NodeConfig.from_env().vm_quiet_idle


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
