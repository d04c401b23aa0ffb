"""Corral on a pure cgroup v2 host (every production distribution now), run
for real: this host is hybrid and its cgroup mounts are not ours to change,
so the tests below run inside tests/framework/v2host.py's guest (Debian's
6.12 kernel, no cgroup v1 memory controller, one cgroup2 hierarchy), on this
checkout, its virtual environment and its layer store.

The core here is the set of tests whose outcome the cgroup layout decides:
limits (memory, pids, CPU), CPU classes, the freezer and CRIU (suspend,
resume, fork), reclaim, removal, and the red team's cgroup attacks. `make
v2-host` runs the container suite's wider set in the same guest
(docs/cgroups.md has its table).
"""

from __future__ import annotations

import shlex

import pytest

from corral.host.cgroups import Mode, detect

from ..framework import v2host

pytestmark = [pytest.mark.integration, pytest.mark.requires_qemu]

CORE = [
    "tests/integration/test_limits.py",
    "tests/integration/test_cpu_classes.py",
    "tests/integration/test_warm_pool.py::test_a_create_claims_a_warm_sandbox_made_into_the_callers",
    "tests/integration/test_suspend.py::test_a_frozen_container_keeps_its_processes_and_stops_them",
    "tests/integration/test_suspend.py::test_a_container_suspended_to_disk_holds_no_process_and_comes_back",
    "tests/integration/test_checkpoints.py::test_a_container_forks_into_copies_of_its_memory_and_files",
    "tests/integration/test_checkpoints.py::test_copies_of_copies_keep_their_cgroups_at_the_nodes_path",
    # The attacker started cold: a warm-claimed one is limited by the same
    # cgroup code once claimed (the warm pool test above checks the claim's
    # limits here), and under the guest's emulated CPU the warm variants
    # doubled the time and failed on timing (a fork bomb slower than its
    # window). `make v2-host` runs both.
    "tests/redteam/test_attacks.py::test_fork_bomb_is_held_by_the_pids_limit[cold]",
    "tests/redteam/test_attacks.py::test_memory_bomb_is_killed_inside[cold]",
    "tests/redteam/test_attacks.py::test_runc_cve_classes[cold]",
    "tests/redteam/test_review.py::test_the_host_device_nodes_a_sandbox_is_given_stay_the_hosts",
]


# A guest under TCG: python starts in seconds; the core took 10-15 min, and
# a rerun after a panic may take twice that.
@pytest.mark.timeout(3800)
def test_the_cgroup_bound_core_passes_on_a_pure_cgroup_v2_host() -> None:
    if detect() is Mode.V2:
        pytest.skip("this host is cgroup v2 itself: the suite runs on it directly")
    command = (
        f"{v2host.GUEST_ENV} .venv/bin/pytest -q -p no:cacheprovider "
        "-m 'integration or redteam' -rfE " + " ".join(shlex.quote(t) for t in CORE)
    )
    r = v2host.run_past_a_panic(command, timeout=1500, single_timeout=2100)
    assert r.rc == 0, r.output[-8000:]
    assert " passed" in r.output, r.output[-3000:]
