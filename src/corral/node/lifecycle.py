"""A sandbox's life on the node: admit -> prepare -> start -> ready, and
the one way out (release), whoever ends it: its caller, its TTL, a failure,
recovery after a crash.

Create records the sandbox and every resource it will hold before making
any (admission.py); so whatever step fails, and even if this process is
killed between two steps, the rows name everything to release (ledger.py,
recovery.py). The states and the changes between them are node/states.py.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from pathlib import Path

from corral import ids, labels, metrics, trace
from corral.api.models import VM_KINDS, CreateSandbox, SandboxInfo
from corral.config import NodeConfig
from corral.errors import (
    Conflict,
    CorralError,
    InvalidArgument,
    SandboxClosed,
    SandboxFailed,
    Unavailable,
)
from corral.execd import protocol as proto
from corral.execd.client import ExecdClient
from corral.host.scratch import Scratch
from corral.images.disks import Disks, disk_name, is_disk
from corral.images.layer import STACK, Layer
from corral.images.mounter import LOADER_STAMP, LayerMounts
from corral.log import bind, get_logger, scope
from corral.node import states
from corral.node.activity import Activity
from corral.node.admission import Admission, AlreadyCreated
from corral.node.audit import Audit
from corral.node.children import Children
from corral.node.cpuclasses import CpuClasses
from corral.node.imagefetch import ImageFetcher
from corral.node.ledger import Ledger
from corral.node.network import SandboxNetworks
from corral.node.records import Records
from corral.node.sandboxdirs import SandboxDirs
from corral.node.store import SandboxRecord, Store
from corral.node.templates import Templates
from corral.node.tothend import ToTheEnd
from corral.runtimes import drawn
from corral.runtimes.base import (
    Boot,
    Diagnosable,
    GuestNet,
    HasDisplay,
    Prepared,
    RenewsLink,
    Resizable,
    Runtime,
    RuntimeSpec,
    Snapshottable,
    diagnose,
    unsupported,
)

MAX_TTL = 30 * 86400  # as CreateSandbox allows

log = get_logger("corral.node")

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Until a new sandbox's exec server answers: a container's init runs in
# milliseconds; a VM's guest boots first (a second or two under KVM, tens
# of seconds under TCG on a loaded host, minutes nested in another TCG
# guest, as the v2 host's tests run them).
READY_TIMEOUT = 30.0
VM_READY_TIMEOUT = 300.0


def merge_env(*layers: list[str] | dict[str, str]) -> list[str]:
    """KEY=VALUE lists/dicts merged left to right; later values win."""
    env: dict[str, str] = {}
    for layer in layers:
        items = (
            layer.items()
            if isinstance(layer, dict)
            else (e.split("=", 1) for e in layer if "=" in e)
        )
        for k, v in items:
            env[k] = v
    env.setdefault("PATH", DEFAULT_PATH)
    return [f"{k}={v}" for k, v in env.items()]


def control_path(run_dir: Path, sandbox_id: str) -> Path:
    """Where a sandbox's exec server listens, on the host (never inside)."""
    return run_dir / f"{sandbox_id}.sock"


def runtime_spec(rec: SandboxRecord) -> RuntimeSpec:
    s = rec.spec
    size = s.get("display_size")
    return RuntimeSpec(
        id=rec.id,
        kind=rec.kind,
        cpu=float(s["cpu"]),
        memory=int(s["memory"]),
        pids=int(s["pids"]),
        disk=int(s["disk"]),
        layers=tuple(rec.layers),
        display_size=(int(size[0]), int(size[1])) if size else None,
        disk_image=disk_name(s["image"]) if is_disk(s["image"]) else None,
        firmware=s.get("firmware") or ("bios" if is_disk(s["image"]) else None),
    )


async def wait_ready(
    sandbox_id: str, control: Path, image: str, kind: str, ready_timeout: float = READY_TIMEOUT
) -> None:
    """Until the sandbox's exec server answers, in our protocol version.
    A user's own disk has none (its guest is ready once drawn).
    `ready_timeout`: a container's bound (NodeConfig.ready_timeout)."""
    if is_disk(image):
        return
    client = ExecdClient(str(control))
    bound = VM_READY_TIMEOUT if kind in VM_KINDS else ready_timeout
    try:
        # One bound over every try: a server that takes the connection
        # and never answers (a guest hung after QEMU came up, a hostile
        # copy's agent) must fail the create, not hold it.
        async with asyncio.timeout(bound):
            while True:
                try:
                    version, _pid = await client.ping()
                    break
                except (Unavailable, ConnectionError):
                    await asyncio.sleep(0.005)
    except TimeoutError:
        raise SandboxFailed(
            f"sandbox {sandbox_id}: exec server did not answer within {bound:.0f}s",
            sandbox=sandbox_id,
        ) from None
    if version != proto.VERSION:
        raise SandboxFailed(
            f"sandbox {sandbox_id}: exec server speaks protocol {version}, "
            f"the agent {proto.VERSION}",
            sandbox=sandbox_id,
        )


class Lifecycle:
    def __init__(
        self,
        config: NodeConfig,
        store: Store,
        *,
        owner: str,
        records: Records,
        admission: Admission,
        ledger: Ledger,
        runtimes: Mapping[str, Runtime],
        layers: LayerMounts,
        scratch: Scratch,
        dirs: SandboxDirs,
        networks: SandboxNetworks,
        audit: Audit,
        activity: Activity,
        children: Children,
        cpu: CpuClasses,
        end_sessions: Callable[[str], None],
        moves: ToTheEnd,
        templates: Templates | None = None,
        after_load: Callable[[SandboxInfo], Awaitable[None]] | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.owner = owner
        self.records = records
        self.admission = admission
        self.ledger = ledger
        self.runtimes = runtimes
        self.layers = layers
        self.images = layers.store
        self.fetcher = ImageFetcher(
            self.images,
            self.config.image_sources,
            guard=config.network_deny if config.pull_guard else None,
        )
        self.disks = Disks(config.disks_dir)
        self.scratch = scratch
        self.dirs = dirs
        self.networks = networks
        self.audit = audit
        self.activity = activity
        self.children = children
        self.cpu = cpu
        self._end_sessions = end_sessions
        self.templates = templates  # full VM desktops loaded, not booted
        self.after_load = after_load  # a copy's fresh randomness and clock
        self.changes = ToTheEnd()  # releases in flight
        # Suspends, resumes and saves in flight (node/snapshots.py runs
        # them): a close waits for them (retire).
        self.moves = moves

    def runtime(self, kind: str) -> Runtime:
        runtime = self.runtimes.get(kind)
        if runtime is None:
            raise InvalidArgument(
                "kind", f"must be one this node runs: {', '.join(sorted(self.runtimes))}", kind
            )
        return runtime

    # ---------------------------------------------------------------- create

    def resolve_layers(self, req: CreateSandbox) -> list[Layer]:
        """Base first (a pulled image: all its layers, bottom first), then
        workspace, then toolkits in the order given. A user's own disk
        has none (it is checked here, before anything is made)."""
        if is_disk(req.image):
            self.disks.get(req.image)
            return []
        project = req.labels.get(labels.PROJECT)

        def resolve(ref: str, field: str) -> Layer:
            layer = self.images.resolve(ref, field, names=False)
            by_name = ref.startswith("sha256:")
            return self.images.for_project(layer, project, field, by_name=by_name)

        layers = [self.images.for_project(layer, project, "image")
                  for layer in self.images.chain(resolve(req.image, "image"))]  # fmt: skip
        if req.workspace:
            layers.append(resolve(req.workspace, "workspace"))
        layers += [resolve(t, f"toolkit[{i}]") for i, t in enumerate(req.toolkit)]
        return layers

    async def create(
        self, req: CreateSandbox, state: Path | None = None, source: str | None = None
    ) -> SandboxInfo:
        """A running sandbox for `req`; with `state`, loaded from that saved
        machine state (a fork or restore) instead of booted. `source`: the
        sandbox of this node that the state is a copy of (a fork's), whose
        learned names a networked copy inherits. A create retried with the
        same idempotency key returns what the first made."""
        earlier = self.admission.earlier(req.idempotency_key)
        if earlier is not None:
            return await self._made_by_key(earlier)
        # The span's children are the phases _create marks; the log scope
        # ends the sandbox id _create binds with this call (an embedded
        # caller's own task goes on without it).
        attrs = {"sandbox.kind": req.kind, "sandbox.image": req.image}
        with trace.span("sandbox.create", **attrs), scope():
            try:
                return await self._create(req, state, source)
            except AlreadyCreated as dup:  # a concurrent create with the same key won
                return await self._made_by_key(dup.sandbox_id)

    async def claim(self, sandbox_id: str, req: CreateSandbox) -> SandboxInfo:
        """Make the warm sandbox `sandbox_id` (node/warmpool.py) the one
        `req` asks for: its record first (admission's claim), then its
        ceilings, disk quota, CPU class and network, as a cold create would
        have started it. It ran nothing of anyone's before (a desktop ran
        its session, as a cold one does before create returns). A claim
        that fails half-way closes the sandbox (nothing of it is handed
        out) and raises; NotWarm if it was taken meanwhile."""
        t0 = time.monotonic()
        runtime = self.runtime(req.kind)
        net_index = self.admission.claim(req, sandbox_id)
        try:
            if not isinstance(runtime, Resizable):
                raise unsupported(req.kind, "warm sandboxes are containers")
            if isinstance(runtime, HasDisplay) and req.display_size:
                # Drawn when it was made; its session may have died since.
                control = control_path(self.config.run_dir, sandbox_id)
                screen = runtime.display(sandbox_id, req.display_size, control)
                await drawn.still_drawn(sandbox_id, screen)
            runtime.resize(sandbox_id, req.cpu, req.memory, req.pids)
            self.scratch.create(sandbox_id, req.disk)  # the claimant's quota
            self.cpu.place(sandbox_id, req.cpu_class, req.cpu)
            if req.network is not None and net_index is not None:
                rec = self.records.get(sandbox_id)
                assert rec.init_pid is not None
                await self.networks.connect(
                    sandbox_id, rec.init_pid, net_index, req.network, runtime.net_tap
                )
        except BaseException as exc:
            await self.retire(sandbox_id, f"claim failed: {exc}")
            if req.idempotency_key is not None:
                self.store.idempotent_drop(req.idempotency_key, sandbox_id)
            raise
        if self.store.on_transition is not None:  # subscribers by label see it now
            self.store.on_transition(sandbox_id, "running")
        elapsed = time.monotonic() - t0
        metrics.SANDBOXES_CREATED.labels(req.kind).inc()
        metrics.CREATE_SECONDS.labels(req.kind).observe(elapsed)
        log.info("sandbox.claimed", sandbox=sandbox_id, ms=round(elapsed * 1000, 2))
        return self.records.info(self.records.get(sandbox_id))

    async def _made_by_key(self, sandbox_id: str) -> SandboxInfo:
        """The sandbox an earlier create with the same key made, once ready."""
        deadline = time.monotonic() + self.config.ready_timeout * 2
        while True:
            rec = self.records.get(sandbox_id)
            if rec.state != "creating":
                break
            if time.monotonic() > deadline:
                raise Unavailable(
                    f"sandbox {sandbox_id}, made for this idempotency key, is still being "
                    "created: retry later",
                    sandbox=sandbox_id,
                )
            await asyncio.sleep(0.02)
        if rec.state == "failed":
            raise SandboxFailed(
                f"the create with this idempotency key failed: {rec.error} (a retry with the "
                "same key creates it afresh)",
                sandbox=sandbox_id,
            )
        return self.records.info(rec)

    def _record(self, req: CreateSandbox, layers: list[Layer]) -> SandboxRecord:
        now = time.time()
        image_env = merge_env(*(layer.config.env for layer in layers))
        return SandboxRecord(
            id=ids.new(self.config.node),
            kind=req.kind,
            state="creating",
            spec=req.model_dump(),
            layers=[layer.digest for layer in layers],
            image_env=image_env,
            workdir="/workspace" if req.workspace else (_image_workdir(layers) or "/"),
            created_at=now,
            expires_at=now + req.ttl if req.ttl else None,
            last_active=now,
            owner=self.owner,
            labels=dict(req.labels),
            image_user=next((x.config.user for x in reversed(layers) if x.config.user), None),
        )

    async def _fetched(self, req: CreateSandbox) -> None:
        """Every layer the create names, fetched first if this node lacks it
        (a registry reference, or one of the node's image sources has it)."""
        refs = [] if is_disk(req.image) else [("image", req.image)]
        if req.workspace:
            refs.append(("workspace", req.workspace))
        refs += [(f"toolkit[{i}]", t) for i, t in enumerate(req.toolkit)]
        for field, ref in refs:
            await self.fetcher.ensure(ref, field)

    async def _create(
        self, req: CreateSandbox, state: Path | None, source: str | None
    ) -> SandboxInfo:
        t0 = time.monotonic()
        runtime = self.runtime(req.kind)
        await self._fetched(req)
        layers = self.resolve_layers(req)
        if req.network is not None:
            self.networks.network.check(req.network)
        rec = self._record(req, layers)
        bind(sandbox=rec.id)
        trace.current().set("sandbox.id", rec.id)
        sandbox_dir = self.config.sandboxes_dir / rec.id
        sub = self.scratch.path(rec.id)
        prep = Prepared(
            lower=[self.layers.path(layer.digest) for layer in reversed(layers)],
            upper=sub / "upper",
            work=sub / "work",
            sandbox_dir=sandbox_dir,
            control=control_path(self.config.run_dir, rec.id),
            env=merge_env(rec.image_env, req.env),
        )
        own = [("dir", str(sandbox_dir)), ("subvolume", rec.id)]
        phases: dict[str, float] = {}
        mark, mark_ns = time.monotonic(), time.time_ns()

        def phase(name: str) -> None:
            """Ends the phase begun at the last mark: a log field (ms) and,
            with tracing on, a child span of sandbox.create over the same
            interval (create.admit, create.prepare: layers mounted and the
            scratch made, create.start: the runtime's, create.ready: its
            exec server answered, create.network)."""
            nonlocal mark, mark_ns
            now, now_ns = time.monotonic(), time.time_ns()
            phases[name] = round((now - mark) * 1000, 2)
            trace.record(f"create.{name}", mark_ns, now_ns)
            mark, mark_ns = now, now_ns

        from_template = False
        net_index = self.admission.admit(req, rec, own + runtime.resources(rec.id, prep))
        prep = replace(prep, host_id=self.admission.host_id(rec.id))
        phase("admit")
        try:
            # What a sandbox keeps on disk (its command log, checkpoints, a
            # VM's files); a container's bundle and rootfs are on the run
            # tmpfs (runtimes/container/oci.py). Traversable for a
            # container's user namespace root (CRIU's restore), not listable.
            self.dirs.make(rec.id, mode=0o711 if runtime.net_tap is None else 0o700)
            self.scratch.create(rec.id, req.disk)  # two ioctls: ~0.1 ms
            if prep.host_id is not None:
                # The merged root is the upper's root: the sandbox's root owns it.
                os.chown(prep.upper, prep.host_id, prep.host_id)
            # Off the loop: a first mount may start the lazy loader (a
            # process, seconds under load) or fetch a pulled layer's metadata
            # from its store; the node's heartbeat and every other request go
            # on meanwhile. (LayerMounts serialises mounts with its lock file,
            # across threads and agents.)
            await asyncio.to_thread(self.layers.ensure_all, layers, sandbox_dir / LOADER_STAMP)
            phase("prepare")
            net = None
            if net_index is not None and runtime.net_tap is not None:
                net = GuestNet(*self.networks.guest_addresses(net_index))  # told at boot
            template = None
            if (
                state is None
                and self.templates is not None
                and isinstance(runtime, Snapshottable)
                and self.templates.applies(req, rec.layers)
            ):
                template = self.templates.key(req, rec.layers, await runtime.state_version())
                if template is not None:
                    state = self.templates.take(template, sandbox_dir / "template.state")
            from_template = template is not None and state is not None
            try:
                started = await runtime.start(runtime_spec(rec), prep, Boot(state=state, net=net))
            except Exception as exc:
                if from_template and template is not None and self.templates is not None:
                    self.templates.drop(template, str(exc))
                raise
            finally:
                if from_template:
                    (sandbox_dir / "template.state").unlink(missing_ok=True)
            phase("start")
            self.children.add(started)
            self.cpu.place(rec.id, req.cpu_class, req.cpu)
            agentless = is_disk(req.image)
            if agentless and req.network is not None and net_index is not None:
                # While its firmware initializes: the guest's OS asks for
                # its address by DHCP as it boots, and may not ask again soon.
                await self.networks.connect(
                    rec.id, started.pid, net_index, req.network, runtime.net_tap, agentless=True
                )
                if state is not None and isinstance(runtime, RenewsLink):
                    # A copy (a fork's): its guest holds its source's lease.
                    # Until it asks again, what it sends from that address
                    # is dropped at the host end (docs/network-copies.md).
                    await runtime.renew_link(rec.id)
                phase("network")
            try:
                await wait_ready(
                    rec.id, prep.control, req.image, req.kind, self.config.ready_timeout
                )
            except SandboxFailed as exc:
                if not isinstance(runtime, Diagnosable):
                    raise
                # A guest that never answered: its console says why.
                raise SandboxFailed(diagnose(runtime, rec.id, exc.message), sandbox=rec.id) from exc
            phase("ready")
            if isinstance(runtime, HasDisplay) and state is None and req.display_size:
                # Ready means drawn: a GUI agent's first screenshot shows
                # the desktop (a restored or forked one already had it).
                await runtime.wait_drawn(rec.id, prep.control, req.display_size)
                phase("drawn")
                if template is not None and self.templates is not None:
                    # Saved before it is handed out: nothing of its user's in it.
                    assert isinstance(runtime, Snapshottable)
                    await self.templates.make(runtime, rec.id, template)
                    phase("template")
            if req.network is not None and net_index is not None and not agentless:
                # Loaded from another's state (not a template, made without
                # a network): it holds that one's address and connections.
                moved = state is not None and not from_template
                await self.networks.connect(
                    rec.id, started.pid, net_index, req.network, runtime.net_tap, moved=moved,
                    names_from=None if source is None else self.networks.index(source),
                )  # fmt: skip
                phase("network")
            if not self.store.transition(
                rec.id, ["creating"], "running", init_pid=started.pid, init_start=started.pid_start
            ):
                raise SandboxClosed(f"sandbox {rec.id} was closed while it was being created")
        except BaseException as exc:
            # A cancelled create (its caller gone, a warm refill stopped
            # with its agent) has no message of its own.
            why = str(exc) or type(exc).__name__
            await self.release(rec.id, "failed", f"create failed: {why}")
            if req.idempotency_key is not None:
                # A retry with the same key may try again.
                self.store.idempotent_drop(req.idempotency_key, rec.id)
            code = exc.code if isinstance(exc, CorralError) else "internal"
            metrics.SANDBOX_CREATE_FAILURES.labels(code).inc()
            log.warning("sandbox.create_failed", sandbox=rec.id, error=why)
            raise
        info = self.records.info(self.records.get(rec.id))
        if from_template and self.after_load is not None:
            await self.after_load(info)
        elapsed = time.monotonic() - t0
        metrics.SANDBOXES_CREATED.labels(req.kind).inc()
        metrics.CREATE_SECONDS.labels(req.kind).observe(elapsed)
        log.info(
            "sandbox.created", sandbox=rec.id, kind=req.kind, ms=round(elapsed * 1000, 2),
            from_template=from_template, **phases,
        )  # fmt: skip
        return info

    # ---------------------------------------------------------------- the way out

    async def release(self, sandbox_id: str, final_state: str, reason: str) -> None:
        """Release every resource of a sandbox that is creating or closing
        (this process won that state), then mark it final_state. Once begun
        it runs to its end (node/tothend.py): a cancelled close had left
        the sandbox "closing", half released, for good."""
        await self.changes.run(sandbox_id, self._release(sandbox_id, final_state, reason))

    async def _release(self, sandbox_id: str, final_state: str, reason: str) -> None:
        rec = self.store.get(sandbox_id)
        if rec is not None:
            try:
                await self.audit.at_close(rec)
            except Exception as exc:  # a report is never worth a leaked sandbox
                log.warning("audit.at_close_failed", sandbox=sandbox_id, error=str(exc))
        self.audit.keep_kernel_counters(sandbox_id)
        errors = await self.ledger.release_all(sandbox_id)
        self.audit.keep_seccomp_counts(sandbox_id)  # its processes are gone now
        self._end_sessions(sandbox_id)
        self.children.reap()
        self.activity.forget(sandbox_id)
        self.cpu.forget(sandbox_id)
        error = (reason + ("; " + "; ".join(errors) if errors else "")) or None
        # Released while closing (closed or failed), or by a create that failed.
        froms = [s for s in ("creating", "closing") if states.allowed(s, final_state)]
        if not self.store.transition(
            sandbox_id, froms, final_state, closed_at=time.time(), error=error
        ):
            log.warning("sandbox.release_raced", sandbox=sandbox_id, state=final_state)

    async def set_ttl(self, sandbox_id: str, ttl: int) -> SandboxInfo:
        """The sandbox's TTL ends `ttl` seconds from now (0: at the next
        housekeeping tick, within a second), running or suspended; its
        on_expiry says what that does."""
        if not 0 <= ttl <= MAX_TTL:
            raise InvalidArgument("ttl", "must be a number of seconds from 0 to 30 days", ttl)
        rec = self.records.get(sandbox_id)
        self.records.not_a_worker(rec)
        if rec.state not in ("running", "suspended", "suspending", "resuming"):
            raise SandboxClosed(f"sandbox {sandbox_id} is {rec.state}", sandbox=sandbox_id)
        spec = {**rec.spec, "ttl": float(ttl)}
        self.store.update(sandbox_id, expires_at=time.time() + ttl, spec=json.dumps(spec))
        return self.records.info(self.records.get(sandbox_id))

    async def close(self, sandbox_id: str, reason: str = "closed by caller") -> None:
        """Close a caller's sandbox (the node's own workers are not theirs)."""
        self.records.not_a_worker(self.records.get(sandbox_id))
        await self.retire(sandbox_id, reason)

    async def retire(self, sandbox_id: str, reason: str) -> None:
        """Close any sandbox of the node: the node's own path (TTL, idle,
        pools, recovery). A suspend, resume or fork's save in flight ends
        first: the close then starts from where it left the sandbox (before,
        a close of a sandbox "suspending" returned and left it as it was)."""
        db = self.store
        for _ in range(5):  # each turn, a change in flight ended
            rec = self.records.get(sandbox_id)
            if rec.state in ("closed", "failed"):
                return
            if db.transition(sandbox_id, ["running", "suspended"], "closing"):
                break
            if rec.state in ("suspending", "resuming"):
                # Registered with the transition that set the state, so
                # in flight here unless another process holds it.
                if await self.moves.wait(sandbox_id):
                    continue
                raise Conflict(
                    f"sandbox {sandbox_id} is {rec.state} in another process: close it once "
                    "that ends", sandbox=sandbox_id, state=rec.state,
                )  # fmt: skip
            if rec.state == "creating" and rec.owner == self.owner:
                # Our own create is in flight: it sees the state and unwinds.
                db.transition(sandbox_id, ["creating"], "closing")
            else:  # closing: returns once closed, if this process closes it
                await self.changes.wait(sandbox_id)
            return
        else:
            raise Conflict(
                f"sandbox {sandbox_id} was suspended and resumed again and again while it "
                "was being closed: close it again", sandbox=sandbox_id,
            )  # fmt: skip
        # A fork's save leaves the record "running": its dump ends before
        # the release takes the processes it reads.
        await self.moves.wait(sandbox_id)
        await self.release(sandbox_id, "closed", reason)
        metrics.SANDBOXES_CLOSED.labels(rec.kind, reason.split(" ")[0]).inc()
        log.info("sandbox.closed", sandbox=sandbox_id, reason=reason)

    async def fail(self, rec: SandboxRecord, why: str) -> None:
        """End a sandbox that died or whose agent died (housekeeping,
        recovery), keeping why, with the guest's own last words if any."""
        why = diagnose(self.runtimes.get(rec.kind), rec.id, why)
        if self.store.transition(rec.id, [rec.state], "closing"):
            log.warning("sandbox.failed", sandbox=rec.id, reason=why)
            await self.release(rec.id, "failed", why)


def _image_workdir(layers: list[Layer]) -> str | None:
    """The image's working directory: the topmost one its layers set (a
    pulled image's config is on the top of its stack, a built image's on
    each step; layers come bottom first). None without layers (a disk)."""
    if not layers:
        return None
    stack = list(itertools.takewhile(lambda x: bool(x.labels.get(STACK)), layers[1:]))
    image = [layers[0], *stack]  # the bottom layer, then those that stack on it
    return next((x.config.workdir for x in reversed(image) if x.config.workdir), None)
