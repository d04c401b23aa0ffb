"""Node configuration of admission: overcommit ratios are refused by name
outside their range, from code and from the environment."""

from __future__ import annotations

import pytest

from corral.config import NodeConfig
from corral.errors import InvalidArgument


@pytest.mark.parametrize("field", ["memory_overcommit", "disk_overcommit"])
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
