"""Which creates may start from a full VM template, and how templates
are kept (node/templates.py)."""

from __future__ import annotations

from pathlib import Path

from corral.api.models import CreateSandbox, validated
from corral.node.templates import Templates

DESK = {"kind": "fullvm", "image": "debian-desktop:bookworm", "toolkit": ["corral-desktop:latest"]}


def _key(t: Templates, **change: object) -> str | None:
    req = validated(CreateSandbox, {**DESK, **change})
    return t.key(req, ["sha256:a", "sha256:b"], "v1")


def test_only_full_vms_of_corral_images_without_a_network_qualify(tmp_path: Path) -> None:
    t = Templates(tmp_path, 4, {"pmem": True})
    assert _key(t) is not None
    assert _key(t, kind="microvm", display_size=None) is None
    assert _key(t, network={"domains": ["example.com"]}) is None
    assert _key(t, image="disk:win", toolkit=[]) is None
    assert Templates(tmp_path, 0, {}).key(validated(CreateSandbox, DESK), ["x"], "v1") is None


def test_the_key_is_everything_the_saved_machine_depends_on(tmp_path: Path) -> None:
    t = Templates(tmp_path, 4, {"pmem": True})
    base = _key(t)
    assert _key(t, labels={"run": "7"}, env={"A": "1"}, ttl=60) == base  # not in the machine
    for change in ({"memory": "3GiB"}, {"cpu": 1}, {"disk": "4GiB"}, {"display_size": "800x600"}):
        assert _key(t, **change) != base, change
    req = validated(CreateSandbox, DESK)
    assert t.key(req, ["sha256:a"], "v1") != base
    assert t.key(req, ["sha256:a", "sha256:b"], "v2") != base
    assert Templates(tmp_path, 4, {"pmem": False}).key(req, ["sha256:a", "sha256:b"], "v1") != base


class _Runtime:
    """Writes a state file as a VM's snapshot would."""

    async def snapshot(self, sandbox_id: str, state: Path) -> int:
        state.write_bytes(sandbox_id.encode())
        return len(sandbox_id)

    async def state_version(self) -> str:
        return "v1"

    async def saved_state(self, sandbox_id: str) -> Path:
        raise NotImplementedError


async def test_templates_are_made_once_linked_for_use_and_the_oldest_dropped(
    tmp_path: Path,
) -> None:
    t = Templates(tmp_path / "t", 2, {})
    assert t.take("k1", tmp_path / "use") is None
    await t.make(_Runtime(), "first", "k1")
    await t.make(_Runtime(), "second", "k1")  # made already: kept as it was
    link = t.take("k1", tmp_path / "use")
    assert link is not None and link.read_bytes() == b"first"
    link.unlink()
    await t.make(_Runtime(), "b", "k2")
    t.take("k1", tmp_path / "use1")  # k1 used: k2 is now the least recent
    await t.make(_Runtime(), "c", "k3")
    assert sorted(p.name for p in (tmp_path / "t").iterdir()) == ["k1.state", "k3.state"]
    # A link taken before an eviction still reads.
    assert (tmp_path / "use1").read_bytes() == b"first"


async def test_a_template_that_did_not_load_is_dropped(tmp_path: Path) -> None:
    t = Templates(tmp_path / "t", 2, {})
    await t.make(_Runtime(), "a", "k1")
    t.drop("k1", "QEMU could not load it")
    assert t.take("k1", tmp_path / "use") is None
    await t.make(_Runtime(), "b", "k1")  # the next boot of the spec saves it anew
    assert (tmp_path / "t" / "k1.state").read_bytes() == b"b"
