"""What the node needs from a sandbox backend, and what a backend may offer.

The node owns records, admission, layers and scratch space; a runtime turns
a prepared sandbox into something running that serves the exec protocol at
a control path, and releases what it made. Every resource a runtime will
create is declared by ``resources()`` and recorded *before* ``start()``
makes it (node/store.py), so a crash at any point leaves rows that name
everything to release.

Every runtime has the four members of ``Runtime``. What only some can do is
a capability, a protocol below that a caller checks with ``isinstance``
(refusing with ``unsupported()``, which names the kind): no caller tests a
runtime's class, so a new backend gains an operation by implementing its
protocol, nothing else.
"""

from __future__ import annotations

import subprocess
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from corral.errors import InvalidArgument

if TYPE_CHECKING:
    from corral.runtimes.vm.pixels import Region, Rgb
    from corral.runtimes.vnc import ByteStream


@dataclass(frozen=True)
class RuntimeSpec:
    """The sandbox as a runtime sees it: its size and its layers, nothing
    of the node's bookkeeping (records, owners, labels)."""

    id: str
    kind: str
    cpu: float
    memory: int  # bytes
    pids: int
    disk: int  # bytes of writable space
    layers: tuple[str, ...]  # digests, base first
    display_size: tuple[int, int] | None = None
    # A full VM booted from a user's own disk (images/disks.py): its name,
    # and the firmware ("bios" or "uefi"); `layers` is then empty.
    disk_image: str | None = None
    firmware: str | None = None


@dataclass(frozen=True)
class Prepared:
    """What the node has made ready before the runtime starts."""

    lower: list[Path]  # mounted layer roots, topmost first
    upper: Path
    work: Path
    sandbox_dir: Path
    control: Path  # where the exec server must listen
    env: list[str]
    host_id: int | None = None  # first host uid/gid of the sandbox's user namespace


@dataclass(frozen=True)
class GuestNet:
    """A VM's address and gateway, told to the guest at boot."""

    address: str
    gateway: str


@dataclass(frozen=True)
class Boot:
    """How start() brings the sandbox up: booted fresh (the default), or
    loaded from a saved machine `state` (a fork or a restore; only a
    runtime that is Snapshottable is ever given one)."""

    state: Path | None = None
    net: GuestNet | None = None  # only for a runtime with a net_tap


FRESH = Boot()


@dataclass(frozen=True)
class Started:
    pid: int
    pid_start: int
    # Set where the process is this process's own child (QEMU, started
    # with Popen): it is reaped through it, subreaper or not.
    process: subprocess.Popen[bytes] | None = field(default=None, compare=False)


Releaser = Callable[[str], Awaitable[None]]


class Runtime(Protocol):
    kind: str
    # The interface inside the sandbox's network namespace that the node's
    # veth is bridged to (a VM's tap), or None when the veth itself is the
    # sandbox's interface, which can then also be added after start.
    net_tap: str | None

    def resources(self, sandbox_id: str, prep: Prepared) -> list[tuple[str, str]]:
        """(kind, ref) of everything start() may create, for the record."""
        ...

    async def start(self, spec: RuntimeSpec, prep: Prepared, boot: Boot) -> Started: ...

    def releasers(self) -> dict[str, Releaser]:
        """The resource kinds this runtime releases, each with its releaser
        (idempotent: releasing what is gone is fine). Kinds a node releases
        itself (cgroup, dir, socket, subvolume, ...) are not listed."""
        ...

    def leftovers(self) -> dict[str, set[str]]:
        """By resource kind (one of releasers()), the refs of what this
        runtime finds on the host: gc releases those no record holds."""
        ...


@runtime_checkable
class Resizable(Protocol):
    """Can change a running sandbox's CPU, memory and pids ceilings (a
    warm sandbox claimed by a create takes the create's)."""

    def resize(self, sandbox_id: str, cpu: float, memory: int, pids: int) -> None: ...


@runtime_checkable
class HostCommands(Protocol):
    """Its commands are processes of the host's kernel, started by
    corral-init in the sandbox's cgroup, so the node can schedule each one
    apart: a command's own CPU class (a VM's run in its guest's kernel)."""

    commands_on_host: bool


@dataclass(frozen=True)
class Suspension:
    """What a suspend left: the bytes it wrote to disk (a machine state, a
    process checkpoint), and for a freeze the blocking call that pushes the
    sandbox's memory out (returning the bytes given back), which the node
    runs after answering and waits for before a resume."""

    state_bytes: int = 0
    reclaim: Callable[[], int] | None = None


@runtime_checkable
class Suspendable(Protocol):
    """Can stop a sandbox and bring it back, processes and all, at one or
    more depths: "freeze" keeps its processes, stopped, and gives back what
    memory the host can take; "disk" saves them and ends them, so the
    sandbox holds only disk."""

    # The depths this runtime offers; the first is its default.
    suspend_modes: tuple[str, ...]

    async def suspend(self, sandbox_id: str, mode: str) -> Suspension: ...

    async def resume(self, sandbox_id: str, mode: str) -> Started | None:
        """Bring it back from `mode`; None: the same processes run on (a
        thaw), so the record's init is still the sandbox's."""
        ...


@runtime_checkable
class Snapshottable(Protocol):
    """Can save a running sandbox's machine state for others to start from
    (fork, save/restore), and start from one (Boot.state)."""

    async def snapshot(self, sandbox_id: str, state: Path) -> int:
        """Save a running sandbox to `state`; it runs on. Returns bytes.
        Files it keeps beside the state are named `state`'s name + a
        suffix, and are dropped with it."""
        ...

    async def state_version(self) -> str:
        """What a saved state needs of the node that loads it (a guest
        kernel's build): states load only where this is equal."""
        ...

    async def saved_state(self, sandbox_id: str) -> Path:
        """The state file of a sandbox suspended to disk, as one file to
        copy to a store (a VM's machine state; a container's checkpoint and
        writable layer, packed)."""
        ...


class Screen(Protocol):
    """A display's screen and input (runtimes/vm/display.py); every
    coordinate is checked against `size` before anything is sent."""

    size: tuple[int, int]
    cursor: tuple[int, int]

    async def frame(self) -> Rgb: ...

    async def screenshot(self, percent: int = 100, region: Region | None = None) -> bytes: ...

    async def pointer(self) -> tuple[int, int]: ...

    async def click(
        self, x: int | None = None, y: int | None = None, button: str = "left", count: int = 1
    ) -> None: ...

    async def move(self, x: int, y: int) -> None: ...

    async def button(
        self, button: str, down: bool, x: int | None = None, y: int | None = None
    ) -> None: ...

    async def drag(self, path: list[tuple[int, int]], button: str = "left") -> None: ...

    async def scroll(
        self, dx: int = 0, dy: int = 0, x: int | None = None, y: int | None = None
    ) -> None: ...

    async def type(self, text: str) -> None: ...

    async def key(self, combo: str) -> None: ...

    async def hold(self, combo: str, down: bool) -> None: ...


@runtime_checkable
class HasDisplay(Protocol):
    def display(self, sandbox_id: str, size: tuple[int, int], control: Path) -> Screen:
        """The sandbox's screen; `control` is its agent's socket."""
        ...

    async def wait_drawn(self, sandbox_id: str, control: Path, size: tuple[int, int]) -> None:
        """Until a freshly booted sandbox's desktop is on its screen."""
        ...

    async def open_vnc(self, sandbox_id: str, control: Path, seconds: float) -> ByteStream:
        """The sandbox's screen as an RFB stream (runtimes/vnc.py), for at
        most `seconds`."""
        ...


@runtime_checkable
class Reattachable(Protocol):
    """Serves a sandbox's control path from the node agent's own process
    (a VM's channel): another agent must attach after this one dies."""

    async def attach(self, sandbox_id: str, control: Path) -> None: ...

    async def detach_all(self) -> None:
        """Stop serving (this agent stops; the sandboxes run on)."""
        ...


@runtime_checkable
class HoldsHandles(Protocol):
    """Holds something of the agent's own (an fd) to let go when it stops."""

    def close_handles(self) -> None: ...


@runtime_checkable
class RenewsLink(Protocol):
    """Can take a guest's network link down and up again: a guest no agent
    configures (a user's own disk) then asks for its address again, as any
    OS does when its cable is plugged back (docs/network-copies.md)."""

    async def renew_link(self, sandbox_id: str) -> None: ...


@runtime_checkable
class Diagnosable(Protocol):
    """Keeps a log of the sandbox's own that says why it died."""

    def console_tail(self, sandbox_id: str, lines: int = 60) -> str: ...

    def bound_logs(self, sandbox_id: str) -> int:
        """Trim that log to its cap (the node calls it on each liveness
        tick); returns the bytes dropped."""
        ...


def unsupported(kind: str, rule: str) -> InvalidArgument:
    """The refusal of an operation a kind's runtime lacks the capability
    for: `rule` says which kinds have it."""
    return InvalidArgument("kind", rule, kind)


def diagnose(runtime: Runtime | None, sandbox_id: str, why: str) -> str:
    """`why`, with the sandbox's own last words where its runtime keeps
    them (a VM's "init" is its emulator: the guest's console says what
    happened inside, a panic or an OOM kill)."""
    if isinstance(runtime, Diagnosable):
        return f"{why}; the guest's last console lines:\n{runtime.console_tail(sandbox_id)}"
    return why
