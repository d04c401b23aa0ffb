"""Node configuration of admission: overcommit ratios, the memory reserve
and pressure limits are refused by name outside their range, from code and
from the environment; and the host's measured load refuses by its rule."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from corral.config import NodeConfig
from corral.errors import InvalidArgument
from corral.host import pressure as psi
from corral.host import swap
from corral.host.pressure import Stall
from corral.node.admission import HostLoad, overloaded


@pytest.mark.parametrize("field", ["memory_overcommit", "disk_overcommit", "cpu_overcommit"])
@pytest.mark.parametrize("value", [0.0, 0.5, -1.0, 1001.0, 1e9])
def test_an_overcommit_outside_1_to_1000_is_refused(field: str, value: float) -> None:
    with pytest.raises(InvalidArgument) as exc:
        NodeConfig(**{field: value})  # type: ignore[arg-type]
    assert exc.value.field == field and "between 1 and 1000" in exc.value.rule


def test_overcommit_and_io_ceilings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORRAL_DISK_OVERCOMMIT", "2.5")
    monkeypatch.setenv("CORRAL_DISK_WRITE_BPS", "64MiB")
    cfg = NodeConfig.from_env()
    assert cfg.disk_overcommit == 2.5 and cfg.disk_write_bps == 64 << 20
    monkeypatch.setenv("CORRAL_DISK_OVERCOMMIT", "0.1")
    with pytest.raises(InvalidArgument, match="disk_overcommit"):
        NodeConfig.from_env()


def test_stores_are_named_and_local_is_always_one() -> None:
    cfg = NodeConfig(stores={"shared": "/mnt/shared"}, store_keys={"shared": "k"})
    assert set(cfg.object_stores) == {"local", "shared"}
    assert cfg.object_stores["local"] == str(cfg.images_dir.parent / "saved")
    for bad in ({"stores": {"/etc": "/etc"}}, {"stores": {"A": "/x"}},
                {"store_keys": {"elsewhere": "k"}}):  # fmt: skip
        with pytest.raises(InvalidArgument) as exc:
            NodeConfig(**bad)  # type: ignore[arg-type]
        assert exc.value.field in ("stores", "store_keys")


@pytest.mark.parametrize(
    ("limits", "field", "rule_part"),
    [
        ({"gpu": 50.0}, "pressure_limits", "'cpu', 'memory' or 'io'"),
        ({"cpu": 0}, "pressure_limits.cpu", "above 0 and at most 100"),
        ({"memory": 150.0}, "pressure_limits.memory", "at most 100"),
        ({"io": "high"}, "pressure_limits.io", "percent"),
        (["cpu"], "pressure_limits", "must map"),
    ],
)
def test_bad_pressure_limits_are_refused(limits: object, field: str, rule_part: str) -> None:
    with pytest.raises(InvalidArgument) as exc:
        NodeConfig(pressure_limits=limits)  # type: ignore[arg-type]
    assert exc.value.field == field and rule_part in exc.value.rule


def test_admission_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORRAL_CPU_OVERCOMMIT", "4")
    monkeypatch.setenv("CORRAL_MEMORY_RESERVE", "2GiB")
    monkeypatch.setenv("CORRAL_PRESSURE_LIMITS", '{"memory": 5}')
    cfg = NodeConfig.from_env()
    assert (cfg.cpu_overcommit, cfg.memory_reserve, cfg.pressure_limits) == (
        4.0,
        2 << 30,
        {"memory": 5},
    )
    monkeypatch.setenv("CORRAL_MEMORY_RESERVE", "-1")
    with pytest.raises(InvalidArgument, match="MEMORY_RESERVE"):
        NodeConfig.from_env()


def load(free: int | None = 8 << 30, **avg: tuple[float, float]) -> HostLoad:
    return HostLoad(free, {res: Stall(*v) for res, v in avg.items()})


LIMITS = {"cpu": 90.0, "memory": 20.0, "io": 50.0}


@pytest.mark.parametrize(
    ("host", "reason", "says"),
    [
        (load(), None, ""),
        (load(None), None, ""),  # no /proc/meminfo: nothing to judge by
        (load(512 << 20), "memory_free", "under memory_reserve"),
        (load(cpu=(95.0, 0.0)), "pressure", "cpu pressure (some avg10) is 95.00%"),
        (load(cpu=(50.0, 99.0)), None, ""),  # cpu's full is not judged
        (load(memory=(90.0, 10.0)), None, ""),  # memory's some is not judged
        (load(memory=(90.0, 25.0)), "pressure", "memory pressure (full avg10)"),
        (load(io=(80.0, 50.0)), "pressure", "at or over its limit 50%"),
    ],
)
def test_the_host_refuses_when_it_measures_too_much(
    host: HostLoad, reason: str | None, says: str
) -> None:
    over = overloaded(host, 1 << 30, LIMITS)
    assert (over[0] if over else None) == reason
    assert says in (over[1] if over else "")


def test_psi_files_are_parsed_and_absent_ones_skipped(tmp_path: Path) -> None:
    (tmp_path / "io").write_text(
        "some avg10=12.50 avg60=1.00 avg300=0.00 total=9\nfull avg10=3.25 avg60=0 avg300=0 total=1\n"
    )
    assert psi.read(tmp_path) == {"io": Stall(12.5, 3.25)}
    assert psi.read(tmp_path / "absent") == {}


def test_zswap_and_ksm_are_turned_on_where_the_kernel_has_them(tmp_path: Path) -> None:
    zswap, ksm = tmp_path / "zswap", tmp_path / "ksm"
    zswap.mkdir()
    ksm.mkdir()
    (zswap / "enabled").write_text("N\n")
    (zswap / "compressor").write_text("lzo\n")
    (ksm / "run").write_text("0\n")
    assert swap.enable_zswap(zswap) and swap.enable_ksm(ksm)
    assert (zswap / "enabled").read_text() == "Y" and (ksm / "run").read_text() == "1"
    assert (zswap / "compressor").read_text() == "lz4"
    assert not swap.enable_zswap(tmp_path / "absent")
    assert not swap.enable_ksm(tmp_path / "absent")


def test_a_swap_file_the_disk_could_not_hold_is_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int, offset: int, size: int) -> None:
        os.write(fd, b"\0" * 4096)  # what it got before the disk filled
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(swap.os, "posix_fallocate", full)
    path = tmp_path / "swap"
    assert not swap.ensure(path, 1 << 30)
    assert not path.exists()
