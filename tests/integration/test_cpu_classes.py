"""CPU classes on the real kernel: a background sandbox's cgroup is idle
and its commands run at SCHED_IDLE, which a process inside cannot undo; a
command's class overrides its sandbox's while it runs; busy background
work gets cores of its own and interactive sandboxes keep to the others
(docs/cpu-classes.md). The latency experiment is bench/cpuclasses.py."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

import corral
from corral.host.cgroups import Mode

from ..framework import IMAGE, agent_of

SCHED_IDLE = 5
POLICY = "python3 -c 'import os; print(os.sched_getscheduler(0))'"
# Try to leave SCHED_IDLE from inside: needs CAP_SYS_NICE in the host's namespace.
ESCAPE = (
    "python3 -c 'import os\n"
    'try:\n    os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0)); print("escaped")\n'
    "except OSError as e:\n    print(e.errno)'"
)


def cgroup_file(client: corral.AsyncClient, controller: str, sandbox_id: str, name: str) -> str:
    cgroups = agent_of(client).parts.cgroups
    d = cgroups._dir(controller, sandbox_id)
    assert d is not None, f"no {controller} cgroup for {sandbox_id}"
    return Path(d, name).read_text().strip()


async def wait_for(check: object, what: str, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():  # type: ignore[operator]
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{what} not within {timeout} s")
        await asyncio.sleep(0.05)


@pytest.fixture
def two_cores() -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("requires 2 CPUs (cores to partition between the classes)")


async def test_a_background_sandbox_yields_and_cannot_climb_back(
    embedded: corral.AsyncClient,
) -> None:
    if agent_of(embedded).parts.cgroups._controller("cpu") is None:
        pytest.skip("requires the cgroup cpu controller")
    bg = await embedded.sandboxes.create(image=IMAGE, cpu_class="background", memory="128MiB")
    it = await embedded.sandboxes.create(image=IMAGE, memory="128MiB")
    assert bg.info.cpu_class == "background" and it.info.cpu_class == "interactive"
    assert cgroup_file(embedded, "cpu", bg.id, "cpu.idle") == "1"
    assert cgroup_file(embedded, "cpu", it.id, "cpu.idle") == "0"
    assert (await bg.commands.run(POLICY)).stdout.strip() == str(SCHED_IDLE)
    assert (await it.commands.run(POLICY)).stdout.strip() == "0"
    # Root inside a background sandbox stays idle: EPERM.
    assert (await bg.commands.run(ESCAPE)).stdout.strip() == "1"


async def test_a_commands_class_overrides_its_sandboxes_while_it_runs(
    embedded: corral.AsyncClient,
) -> None:
    it = await embedded.sandboxes.create(image=IMAGE, memory="128MiB")
    bg = await embedded.sandboxes.create(image=IMAGE, cpu_class="background", memory="128MiB")
    r = await it.commands.run(POLICY, cpu_class="background")
    assert r.stdout.strip() == str(SCHED_IDLE)
    # A background command lowers an interactive sandbox while it runs...
    h = await it.commands.start("sleep 30", cpu_class="background")
    assert cgroup_file(embedded, "cpu", it.id, "cpu.idle") == "1"
    # ...and an interactive one beside it lifts it again.
    r = await it.commands.run("cat /proc/self/cgroup >/dev/null; echo ok")
    await h.kill()
    await h.wait()
    assert cgroup_file(embedded, "cpu", it.id, "cpu.idle") == "0"
    # An interactive command lifts a background sandbox for its duration.
    h = await bg.commands.start("sleep 30", cpu_class="interactive")
    assert cgroup_file(embedded, "cpu", bg.id, "cpu.idle") == "0"
    await h.kill()
    await h.wait()
    assert cgroup_file(embedded, "cpu", bg.id, "cpu.idle") == "1"


async def test_busy_background_work_keeps_to_cores_of_its_own(
    embedded: corral.AsyncClient, two_cores: None
) -> None:
    agent = agent_of(embedded)
    if agent.parts.cgroups.mode is Mode.V2 and "cpuset" not in (
        Path("/sys/fs/cgroup/cgroup.controllers").read_text().split()
    ):
        pytest.skip("requires the cpuset controller (not in /sys/fs/cgroup/cgroup.controllers)")
    cpus = sorted(os.sched_getaffinity(0))
    every = f"{cpus[0]}-{cpus[-1]}"
    bg = await embedded.sandboxes.create(image=IMAGE, cpu_class="background", memory="128MiB")
    it = await embedded.sandboxes.create(image=IMAGE, memory="128MiB")

    def cpusets() -> tuple[str, str]:
        return (cgroup_file(embedded, "cpuset", bg.id, "cpuset.cpus"),
                cgroup_file(embedded, "cpuset", it.id, "cpuset.cpus"))  # fmt: skip

    await wait_for(lambda: cpusets() == (every, every), "every core shared while nothing is busy")
    busy = await bg.commands.start("sleep 60")
    last = str(cpus[-1])
    # Confined (the default): interactive sandboxes keep to the others. (One
    # pass writes each sandbox's cpuset in turn: waited for as a whole.)
    await wait_for(
        lambda: cpusets()[0] == last and last not in cpusets()[1].split(",")
        and cpusets()[1] != every,
        "the background sandbox on the last core, the interactive one off it",
    )  # fmt: skip
    # A sandbox created now joins the partition as it stands.
    late = await embedded.sandboxes.create(image=IMAGE, memory="128MiB")
    assert cgroup_file(embedded, "cpuset", late.id, "cpuset.cpus") == cpusets()[1]
    await busy.kill()
    await busy.wait()
    await wait_for(lambda: cpusets() == (every, every), "every core shared again")
    await wait_for(
        lambda: cgroup_file(embedded, "cpuset", late.id, "cpuset.cpus") == every,
        "the late sandbox on every core again",
    )


async def test_a_commands_class_on_a_vm_is_refused(embedded: corral.AsyncClient) -> None:
    from corral.runtimes.vm.runtime import vm_capable

    if not vm_capable():
        pytest.skip("requires QEMU and a guest kernel (microVMs)")
    vm = await embedded.sandboxes.create(kind="microvm", image=IMAGE, cpu_class="background")
    assert (await vm.commands.run("echo up")).stdout == "up\n"
    with pytest.raises(corral.InvalidArgument) as exc:
        await vm.commands.run("true", cpu_class="interactive")
    assert exc.value.field == "cpu_class" and "microvm" in str(exc.value)
