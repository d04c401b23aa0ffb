"""What this host's PID 1 costs per network namespace, with no Corral code
running: the ceiling behind bench/results/density.md.

PID 1 on these machines is not an init system but the VM's own process
agent (`process_api`, at nice -10). Its CPU grows with the number of
network namespaces that hold a process, and at nice -10 it takes the CPU
ahead of everything at nice 0. Each step holds N `sleep` processes, either
one network namespace each (what N network-isolated sandboxes are), all in
one namespace, or N namespaces pinned by `ip netns` with no process in
them; then, for 30 s, it samples PID 1's CPU and the latency of spawning
`/bin/true` from the host (fork, exec, wait: the smallest thing a node
does per command), at nice 0 and at nice -10, interleaved.

  corral bench hostpid1 [--steps 0,1000,2000,4000,8000] [--window 30]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import host_busy, pct, table, write_result

NICE = (0, -10)


def pid1_cpu() -> float:
    fields = Path("/proc/1/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Holders:
    """N idle processes (or bare namespaces) of one shape, grown in place."""

    def __init__(self, mode: str) -> None:
        self.mode, self.procs, self.netns = mode, list[subprocess.Popen[bytes]](), 0
        self.anchor: subprocess.Popen[bytes] | None = None

    def __len__(self) -> int:
        return self.netns if self.mode == "ip netns, no process" else len(self.procs)

    def grow(self, n: int) -> None:
        while len(self) < n:
            if self.mode == "ip netns, no process":
                subprocess.run(["ip", "netns", "add", f"corral-p1-{self.netns}"], check=True)
                self.netns += 1
                continue
            if self.mode == "one netns each":
                argv = ["unshare", "-n", "sleep", "infinity"]
            else:
                if self.anchor is None:
                    self.anchor = subprocess.Popen(["unshare", "-n", "sleep", "infinity"])
                    time.sleep(0.2)
                argv = ["nsenter", "-t", str(self.anchor.pid), "-n", "sleep", "infinity"]
            self.procs.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL))

    def close(self) -> None:
        for p in [*self.procs, *([self.anchor] if self.anchor else [])]:
            p.send_signal(signal.SIGKILL)
        for p in [*self.procs, *([self.anchor] if self.anchor else [])]:
            p.wait()
        for i in range(self.netns):
            subprocess.run(["ip", "netns", "del", f"corral-p1-{i}"], check=True)
        self.procs, self.anchor, self.netns = [], None, 0


def settle(limit: float = 300.0) -> float:
    """Wait until the host, PID 1 aside, is quiet (under a tenth of a core
    busy over 2 s): the kernel frees a killed process's network namespace
    later, in a workqueue, and thousands of them keep a core busy for a
    while. PID 1's own CPU is what is measured, so it does not count.
    Returns the seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        b, p = host_busy(), pid1_cpu()
        time.sleep(2)
        if (host_busy() - b) - (pid1_cpu() - p) < 0.2:
            break
    return time.monotonic() - t0


def sample(window: float) -> tuple[float, dict[int, list[float]]]:
    """PID 1's share of a core over the window, and spawn latencies (ms)
    at each nice level."""
    lat: dict[int, list[float]] = {n: [] for n in NICE}
    c0, t0 = pid1_cpu(), time.monotonic()
    i = 0
    while time.monotonic() - t0 < window:
        level = NICE[i % len(NICE)]
        os.setpriority(os.PRIO_PROCESS, 0, level)
        t = time.perf_counter()
        subprocess.run(["/bin/true"], check=True)
        lat[level].append((time.perf_counter() - t) * 1000)
        os.setpriority(os.PRIO_PROCESS, 0, 0)
        i += 1
        time.sleep(0.05)
    return (pid1_cpu() - c0) / (time.monotonic() - t0), lat


def main(steps: list[int], window: float) -> None:
    if os.geteuid() != 0:
        sys.exit("hostpid1 needs root (namespaces, nice -10)")
    plan = [("one netns each", steps), ("all in one netns", [max(steps)])]
    plan.append(("ip netns, no process", [max(steps)]))
    rows = []
    for mode, counts in plan:
        holders = Holders(mode)
        try:
            for n in counts:
                t = time.monotonic()
                holders.grow(n)
                made = time.monotonic() - t
                settle()
                share, lat = sample(window)
                row = [mode, str(n), f"{share:.0%}"]
                for level in NICE:
                    row += [f"{pct(lat[level], 50):.2f}", f"{pct(lat[level], 99):.2f}"]
                rows.append(row)
                print(" | ".join(row), f"(made in {made:.0f} s)", flush=True)
        finally:
            holders.close()
            print(f"{mode}: quiet {settle():.0f} s after the close", flush=True)
    header = ["held", "N", "host PID 1 CPU (of a core)"]
    for level in NICE:
        header += [f"spawn `true` p50 ms (nice {level})", f"p99 ms (nice {level})"]
    path = write_result(
        "hostpid1",
        "This host's PID 1: its cost per network namespace",
        [
            "PID 1 here is the VM's process agent (`process_api`, nice -10), not an "
            "init system. Each row holds N idle `sleep` processes (or N bare "
            "namespaces), waits for the host, PID 1 aside, to be quiet (the kernel "
            f"frees namespaces late), then samples for {window:.0f} s: PID 1's CPU, "
            "and spawning `/bin/true` from the host every 50 ms, alternating nice 0 "
            "and nice -10. No Corral code runs.",
            table(header, rows),
            "A network namespace costs PID 1 CPU only while a process is in it, and "
            "once per namespace, not per process: N processes in one namespace cost "
            "what N plain processes do. N sandboxes with their own network (each is "
            "isolated, so each has one) are N such namespaces. The spawn p99s rest on "
            "~300 samples a level, so one stall decides them: they say that the host "
            "alone has tails of tens of ms once thousands of processes are held, not "
            "how they trend.",
        ],
    )
    print(path)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", default="0,1000,2000,4000,8000")
    ap.add_argument("--window", type=float, default=30.0, help="seconds sampled per step")
    a = ap.parse_args()
    main([int(s) for s in a.steps.split(",")], a.window)
