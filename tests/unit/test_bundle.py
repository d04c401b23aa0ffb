from __future__ import annotations

from pathlib import Path

from corral.runtimes.container import bundle


def _config() -> dict:  # type: ignore[type-arg]
    return bundle.config(
        bundle.BundleSpec(
            sandbox_id="n-1",
            rootfs=Path("/r"),
            platform_dir=Path("/p"),
            env=["A=1"],
            cpu=0.5,
            memory=256 * 2**20,
            pids=64,
            cgroups_path="/corral/n/n-1",
            swap_accounting=True,
        )
    )


def test_limits_reach_the_oci_spec() -> None:
    res = _config()["linux"]["resources"]
    assert res["memory"] == {"limit": 256 * 2**20, "swap": 256 * 2**20}
    assert res["cpu"]["quota"] == 50_000 and res["cpu"]["period"] == 100_000
    assert res["pids"] == {"limit": 64}


def test_isolation_defaults() -> None:
    cfg = _config()
    ns = {n["type"] for n in cfg["linux"]["namespaces"]}
    assert ns == {"pid", "network", "ipc", "uts", "mount", "cgroup"}
    proc = cfg["process"]
    assert proc["noNewPrivileges"] is True
    assert proc["args"] == ["/.corral/bin/corral-init"]
    assert "CAP_SYS_ADMIN" not in proc["capabilities"]["bounding"]
    assert "CAP_SYS_PTRACE" not in proc["capabilities"]["bounding"]
    assert "/proc/kcore" in cfg["linux"]["maskedPaths"]
    assert "/proc/sys" in cfg["linux"]["readonlyPaths"]
    platform = [m for m in cfg["mounts"] if m["destination"] == "/.corral"]
    assert platform and "ro" in platform[0]["options"]


def test_masked_directories_are_bound_to_one_empty_directory(tmp_path: Path) -> None:
    """No tmpfs of their own (a superblock each, costly per memory cgroup):
    the directories bind the platform's empty one, read-only; masked files
    stay crun's (/dev/null over each)."""
    masked, binds = bundle.masks(tmp_path)
    dirs = {b["destination"] for b in binds}
    assert dirs and all(Path(d).is_dir() for d in dirs)
    assert not dirs & set(masked)
    assert set(masked) | dirs == set(bundle.profile.MASKED_PATHS)
    for b in binds:
        assert b["source"] == str(tmp_path) and b["type"] == "bind"
        assert {"ro", "nosuid", "nodev", "noexec"} <= set(b["options"])
    # Without one (an older platform), crun masks everything itself.
    assert bundle.masks(None) == (list(bundle.profile.MASKED_PATHS), [])


def test_an_init_that_died_at_start_is_quoted_bounded_not_pointed_at(tmp_path: Path) -> None:
    from corral.runtimes.container.runtime import _last_words

    out, log = tmp_path / "oci.out", tmp_path / "oci.log"
    assert _last_words(out, log) == "nothing"  # neither written
    out.write_text("x" * 100_000 + "\nline 1\nline 2\ncorral-init: bind: Address in use\n")
    log.write_text('{"msg": "container exited"}\n')
    said = _last_words(out, log)
    assert said.endswith('corral-init: bind: Address in use | {"msg": "container exited"}')
    assert len(said) <= 600 and "line 1" in said


def test_cgroup_v1_is_binds_of_a_skeleton_and_the_sandboxs_own_cgroups(tmp_path: Path) -> None:
    dirs = (("memory", Path("/sys/fs/cgroup/memory/c/n-1")),
            ("pids", Path("/sys/fs/cgroup/pids/c/n-1")))  # fmt: skip
    ms = bundle.cgroup_mounts(tmp_path, dirs)
    assert [m["destination"] for m in ms] == [
        "/sys/fs/cgroup", "/sys/fs/cgroup/memory", "/sys/fs/cgroup/pids"]  # fmt: skip
    assert ms[0]["source"] == str(tmp_path)
    assert [m["source"] for m in ms[1:]] == [str(d) for _, d in dirs]
    for m in ms:
        assert m["type"] == "bind" and {"ro", "nosuid", "nodev", "noexec"} <= set(m["options"])
    # Without a skeleton (cgroup v2: one mount, no superblock of its own), crun's.
    (only,) = bundle.cgroup_mounts(None, ())
    assert only["type"] == "cgroup" and "ro" in only["options"]
