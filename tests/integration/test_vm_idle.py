"""An idle microVM keeps its guest kernel's periodic work off (each wakeup
of an emulated CPU is host CPU; bench/results/vmdensity.md): the guest
runs with the soft-lockup watchdog and pressure averaging off, statistics
folded once a minute and no proactive compaction, and its clocks and
timers still work."""

from __future__ import annotations

import pytest

import corral

from ..framework import IMAGE

pytestmark = pytest.mark.requires_qemu


async def test_an_idle_guest_has_its_periodic_work_off_and_working_timers(
    embedded: corral.AsyncClient,
) -> None:
    s = await embedded.sandboxes.create(kind="microvm", image=IMAGE, memory="256MiB")
    try:
        r = await s.commands.run(
            "cat /proc/sys/vm/stat_interval /proc/sys/vm/compaction_proactiveness"
            " /proc/sys/kernel/watchdog; cat /proc/pressure/cpu 2>/dev/null || echo no-psi;"
            " a=$(date +%s%N); sleep 0.3; b=$(date +%s%N); echo $(( (b - a) / 1000000 ))"
        )
        assert r.exit_code == 0, r.stderr
        interval, proactive, watchdog, psi, slept = r.stdout.split()
        assert (interval, proactive, watchdog, psi) == ("60", "0", "0", "no-psi")
        assert int(slept) >= 300  # a timer fires, on a clock that moves
        cmdline = (await s.files.read("/proc/cmdline")).decode().split()
        assert "nowatchdog" in cmdline and "psi=0" in cmdline
    finally:
        await s.close()
