"""Sandboxes that stop and come back: suspend and resume, fork into copies,
save to an object store and restore on any node. Each is a capability a
runtime may have (runtimes/base.py Suspendable, Snapshottable); a kind
without it is refused by name.

A save writes the machine state and a signed record of what it needs (its
spec, its exact layers by digest, the state format's version) beside it;
restore checks the signature before it trusts the record, and the state's
digest before the runtime reads a byte of it (node/signing.py says why).
"""

from __future__ import annotations

import asyncio
import builtins
import json
import secrets
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from corral import labels, metrics
from corral.api.models import (
    VM_KINDS,
    CreateSandbox,
    ForkRequest,
    SandboxInfo,
    SavedState,
    SaveRequest,
)
from corral.config import NodeConfig
from corral.errors import (
    Conflict,
    CorralError,
    ImageNotFound,
    InvalidArgument,
    NotFound,
    SandboxFailed,
)
from corral.images import registry
from corral.images.disks import is_disk
from corral.images.mounter import LOADER_STAMP, LayerMounts
from corral.images.objects import ObjectStore, open_store
from corral.log import get_logger
from corral.node import signing
from corral.node.activity import Activity
from corral.node.children import Children
from corral.node.cpuclasses import INTERACTIVE
from corral.node.lifecycle import Lifecycle, control_path, wait_ready
from corral.node.network import SandboxNetworks
from corral.node.records import Records
from corral.node.reseed import reseed_copies, set_guest_clock
from corral.node.store import SandboxRecord, Store
from corral.runtimes.base import Runtime, Snapshottable, Suspendable, unsupported

log = get_logger("corral.node")

VM_STATES = "vmstates"  # the object-store prefix of saved states


def _quiet(task: str, done: float, total: float | None) -> None:
    pass


def _download(store: ObjectStore, key: str, dest: Path, step: int = 8 << 20) -> None:
    size = store.size(key)
    with open(dest, "wb") as f:
        for off in range(0, size, step):
            f.write(store.get_range(key, off, min(step, size - off)))


def fresh_secrets(tags: dict[str, str]) -> dict[str, str]:
    """New values for the source's own secrets (labels.SECRETS) it has: a
    copy is another sandbox, and its source's token must not open it."""
    return {k: secrets.token_urlsafe(24) for k in labels.SECRETS if k in tags}


SAVED_MAX = 1 << 30  # a saved state's record (saved.json), read before its MAC: what a save held


class Snapshots:
    def __init__(
        self,
        config: NodeConfig,
        store: Store,
        *,
        records: Records,
        lifecycle: Lifecycle,
        runtimes: Mapping[str, Runtime],
        layers: LayerMounts,
        networks: SandboxNetworks,
        children: Children,
        activity: Activity,
    ) -> None:
        self.config = config
        self.store = store
        self.records = records
        self.lifecycle = lifecycle
        self.runtimes = runtimes
        self.layers = layers
        self.networks = networks
        self.children = children
        self.activity = activity
        self._reclaims: dict[str, asyncio.Task[None]] = {}
        self.changes = lifecycle.moves  # suspends, resumes, forks' saves in flight

    # ---------------------------------------------------------------- suspend

    async def awake(self, sandbox_id: str) -> SandboxRecord:
        """The record of a running sandbox: a change in flight (a suspend,
        a resume, a fork's save) ends first, and a suspended one is
        resumed (the next request restores it). A request during a fork's
        save had found the exec server parked and failed as if the
        sandbox had died."""
        for _ in range(5):  # each turn, a change in flight ended
            await self.changes.wait(sandbox_id)
            state = self.records.get(sandbox_id).state
            if state == "suspended":
                await self.resume(sandbox_id)
            elif state not in ("suspending", "resuming"):
                break
        return self.records.running(sandbox_id)

    def _suspendable(self, rec: SandboxRecord, mode: str | None) -> tuple[Suspendable, str]:
        runtime = self.runtimes.get(rec.kind)
        if not isinstance(runtime, Suspendable) or not runtime.suspend_modes:
            raise unsupported(
                rec.kind, "suspend is supported for container, microvm and fullvm sandboxes"
            )
        if mode is None:
            return runtime, runtime.suspend_modes[0]
        if mode not in runtime.suspend_modes:
            raise InvalidArgument(
                "mode", f"must be one of {', '.join(runtime.suspend_modes)} for a {rec.kind}", mode
            )
        return runtime, mode

    async def suspend(
        self, sandbox_id: str, mode: str | None = None, key: str | None = None
    ) -> SandboxInfo:
        """Stop a running sandbox, its processes kept: frozen in place
        ("freeze", its memory pushed out where the host can) or saved to
        disk and ended ("disk"). resume() or the next request brings it
        back. A suspended sandbox is left as it is, unless asked to go
        deeper (disk, from freeze: it is thawed and saved). A suspend or
        resume of it in flight here ends first (a request's resume had made
        a suspend asked meanwhile a Conflict). With `key`, only the first
        call with that key acts: a retried preemption hook does not suspend
        a sandbox that was resumed since."""
        rec = self.records.get(sandbox_id)
        self._suspendable_now(rec)
        runtime, mode = self._suspendable(rec, mode)
        if key is not None and not self.store.op_key(sandbox_id, f"suspend:{key}"):
            return self.records.info(rec)  # this key already acted
        for _ in range(5):  # each turn, a change in flight here ended
            await self.changes.wait(sandbox_id)
            rec = self.records.get(sandbox_id)
            self._suspendable_now(rec)
            if rec.state == "suspended":
                if not (rec.suspended == "freeze" and mode == "disk"):
                    return self.records.info(rec)
                await self.resume(sandbox_id)
            checkpoint = mode == "disk" and getattr(runtime, "disk_needs_idle", False)
            if checkpoint:
                await self._idle_for_checkpoint(sandbox_id, runtime)
            unplug = checkpoint and self.networks.has_network(sandbox_id)
            if self.store.transition(sandbox_id, ["running"], "suspending"):
                return await self.changes.run(sandbox_id, self._suspend(rec, runtime, mode, unplug))
            if not self.changes.busy(sandbox_id):
                break
        state = self.records.get(sandbox_id).state
        raise Conflict(f"sandbox {sandbox_id} is {state}: it cannot be suspended now",
                       sandbox=sandbox_id, state=state)  # fmt: skip

    def _suspendable_now(self, rec: SandboxRecord) -> None:
        if rec.state in ("closed", "failed", "closing"):
            raise Conflict(f"sandbox {rec.id} is {rec.state}: it cannot be suspended",
                           sandbox=rec.id)  # fmt: skip

    async def _suspend(
        self, rec: SandboxRecord, runtime: Suspendable, mode: str, unplug: bool
    ) -> SandboxInfo:
        sandbox_id, db = rec.id, self.store
        t0 = time.monotonic()
        try:
            if unplug:
                assert rec.init_pid is not None
                await self.networks.unplug(sandbox_id, rec.init_pid)
            done = await runtime.suspend(sandbox_id, mode)
        except BaseException:
            if unplug and rec.init_pid is not None:
                await self.networks.reconnect(sandbox_id, rec.init_pid, None)
            db.transition(sandbox_id, ["suspending"], "running")
            raise
        db.transition(sandbox_id, ["suspending"], "suspended", suspended=mode)
        if done.reclaim is not None:
            self._reclaims[sandbox_id] = asyncio.create_task(
                self._reclaim(sandbox_id, done.reclaim)
            )
        metrics.SUSPEND_OPS.labels(rec.kind, "suspend", mode).observe(time.monotonic() - t0)
        metrics.VM_STATE_BYTES.labels("suspend").inc(done.state_bytes)
        log.info("sandbox.suspended", sandbox=sandbox_id, mode=mode,
                 ms=round((time.monotonic() - t0) * 1000, 1),
                 state_bytes=done.state_bytes)  # fmt: skip
        return self.records.info(self.records.get(sandbox_id))

    async def _reclaim(self, sandbox_id: str, reclaim: Callable[[], int]) -> None:
        """Push a frozen sandbox's memory out, after the caller has its
        answer (it costs ~1 ms per MiB pushed to swap)."""
        t0 = time.monotonic()
        try:
            n = await asyncio.to_thread(reclaim)
        finally:
            self._reclaims.pop(sandbox_id, None)
        metrics.RECLAIMED_BYTES.inc(n)
        log.info("sandbox.reclaimed", sandbox=sandbox_id, bytes=n,
                 ms=round((time.monotonic() - t0) * 1000, 1))  # fmt: skip

    async def aclose(self) -> None:
        """Let the reclaims (each is one blocking write), suspends and
        resumes in flight finish."""
        await asyncio.gather(*self._reclaims.values(), return_exceptions=True)
        await self.changes.aclose()

    async def settled(self, sandbox_id: str) -> None:
        """Wait for a freeze's reclaim of this sandbox, if one runs: a
        resume (or a close) must not race with it."""
        task = self._reclaims.get(sandbox_id)
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)

    async def _idle_for_checkpoint(self, sandbox_id: str, runtime: object) -> None:
        """A container is checkpointed only with no command running (their
        connections cannot be carried): wait checkpoint_wait for them to
        end (a preemption hook often finds the last ones finishing)."""
        if not getattr(runtime, "disk_needs_idle", False):
            return
        deadline = time.monotonic() + self.config.checkpoint_wait
        for _ in range(int(self.config.checkpoint_wait * 100) + 1):  # polled: no event to wait on
            if not self.activity.running(sandbox_id) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.01)
        if self.activity.running(sandbox_id):
            raise Conflict(
                f"sandbox {sandbox_id} is running {self.activity.running(sandbox_id)} "
                "command(s): a checkpoint cannot carry their connections; freeze it instead, "
                "or checkpoint it when they end",
                sandbox=sandbox_id,
            )

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        """Bring a suspended sandbox back; a running one is left as it is.
        A suspend or resume of it in flight here ends first."""
        for _ in range(5):  # each turn, a change in flight here ended
            await self.changes.wait(sandbox_id)
            rec = self.records.get(sandbox_id)
            if rec.state == "running":
                return self.records.info(rec)
            if self.store.transition(sandbox_id, ["suspended"], "resuming"):
                return await self.changes.run(sandbox_id, self._resume(rec))
            if not self.changes.busy(sandbox_id):
                break
        if rec.state == "suspending":  # by another process: its agent died, or it is
            raise Conflict(
                f"sandbox {sandbox_id} is being suspended by another process: resume it "
                "once it is suspended",
                sandbox=sandbox_id,
                state=rec.state,
            )
        for _ in range(3000):  # polled: another process is resuming it
            rec = self.records.get(sandbox_id)
            if rec.state != "resuming":
                break
            await asyncio.sleep(0.01)
        return self.records.info(self.records.running(sandbox_id))

    async def _resume(self, rec: SandboxRecord) -> SandboxInfo:
        sandbox_id, db = rec.id, self.store
        t0 = time.monotonic()
        mode = rec.suspended or "disk"
        runtime, mode = self._suspendable(rec, mode)
        await self.settled(sandbox_id)
        if not await self._layers_still_there(rec, mode):
            why = "the node's lazy layer loader died while it was suspended; it lost its files"
            await self.lifecycle.fail(self.records.get(sandbox_id), why)
            raise SandboxFailed(f"sandbox {sandbox_id}: {why}", sandbox=sandbox_id)
        started = None
        try:
            started = await runtime.resume(sandbox_id, mode)
            if started is not None:
                self.children.add(started)
                # A new cgroup (a restored checkpoint's): its class again.
                self.lifecycle.cpu.place(
                    sandbox_id, rec.spec.get("cpu_class", INTERACTIVE), rec.spec.get("cpu", 1.0)
                )
                control = control_path(self.config.run_dir, sandbox_id)
                await wait_ready(
                    sandbox_id, control, rec.spec["image"], rec.kind, self.config.ready_timeout
                )
                await self.networks.reconnect(
                    sandbox_id, started.pid, self.runtimes[rec.kind].net_tap,
                    agentless=is_disk(rec.spec["image"]),
                )  # fmt: skip
        except BaseException as exc:
            if started is not None:
                # Loaded, then broken (its exec server never answered, its
                # network would not come back): its processes run, so it is
                # not suspended, and it cannot be used, so it is not running.
                # It fails and is released, its checkpoint with it.
                why = f"resume failed once its state was loaded: {exc or type(exc).__name__}"
                await self.lifecycle.fail(self.records.get(sandbox_id), why)
                if not isinstance(exc, Exception):
                    raise
                raise SandboxFailed(f"sandbox {sandbox_id}: {why}", sandbox=sandbox_id) from exc
            db.transition(sandbox_id, ["resuming"], "suspended")
            if isinstance(exc, CorralError) or not isinstance(exc, Exception):
                raise
            raise SandboxFailed(f"sandbox {sandbox_id}: resume failed: {exc}") from exc
        if rec.kind in VM_KINDS and not is_disk(rec.spec["image"]):
            # Its wall clock stopped with it (frozen or saved): now again.
            await set_guest_clock(self.config.run_dir, sandbox_id)
        pids = {} if started is None else {"init_pid": started.pid, "init_start": started.pid_start}
        db.transition(sandbox_id, ["resuming"], "running", suspended=None, **pids)
        # A resumed sandbox was just used: the idle policy starts again.
        self.store.touch({sandbox_id: time.time()})
        metrics.SUSPEND_OPS.labels(rec.kind, "resume", mode).observe(time.monotonic() - t0)
        log.info("sandbox.resumed", sandbox=sandbox_id, mode=mode,
                 ms=round((time.monotonic() - t0) * 1000, 1))  # fmt: skip
        return self.records.info(self.records.get(sandbox_id))

    async def _layers_still_there(self, rec: SandboxRecord, mode: str) -> bool:
        """Resumed from disk, a sandbox's new processes (a restored tree's
        overlay, a new QEMU) open its layers again: through the node's
        mounts as they are now, mounted again if the loader it was made
        with died while it was away (a create or the leader cleared them),
        and stamped with the loader epoch they belong to. Resumed from
        freeze, it holds what it opened then: False if that loader has
        died since (the leader fails running sandboxes only; one frozen
        then would run on with every read failing)."""
        if not rec.layers:
            return True  # its own disk: no layer of the node's
        layers = self.lifecycle.layers
        stamp = self.config.sandboxes_dir / rec.id / LOADER_STAMP
        if mode == "disk":
            found = [layers.store.get(d, names=False) for d in rec.layers]
            await asyncio.to_thread(layers.ensure_all, found, stamp)
            return True
        try:
            mounted_in = int(stamp.read_text())
        except (FileNotFoundError, ValueError):
            return True  # not mounted through the node's layer mounts
        return mounted_in >= await asyncio.to_thread(layers.epoch)

    # ---------------------------------------------------------------- fork

    def _snapshottable(self, rec: SandboxRecord, what: str) -> Snapshottable:
        runtime = self.runtimes.get(rec.kind)
        if not isinstance(runtime, Snapshottable) or not getattr(runtime, "can_snapshot", True):
            raise unsupported(
                rec.kind, f"{what} is for microvm, fullvm and (with CRIU) container sandboxes"
            )
        return runtime

    async def _running_and_idle(self, sandbox_id: str, runtime: Snapshottable) -> SandboxRecord:
        """Its record, running and with no command, as of the return: a
        suspend asked while the fork waited for commands to end is waited
        for and undone (the next request would resume it too)."""
        for _ in range(5):
            await self.awake(sandbox_id)
            await self._idle_for_checkpoint(sandbox_id, runtime)
            rec = self.records.get(sandbox_id)
            if rec.state == "running":
                return rec
        raise Conflict(
            f"sandbox {sandbox_id} was suspended again and again while it was being forked: "
            "fork it again", sandbox=sandbox_id,
        )  # fmt: skip

    async def fork(self, sandbox_id: str, req: ForkRequest) -> builtins.list[SandboxInfo]:
        """`n` new sandboxes, each a copy of this one as it is now: its
        memory, processes and files. The source pauses while its state is
        saved (~0.1 s per 256 MiB), then runs on; each copy loads the state
        into a machine of its own (its own id, channel and cgroup)."""
        runtime = self._snapshottable(self.records.get(sandbox_id), "fork")
        rec = await self._running_and_idle(sandbox_id, runtime)
        # From here to the save's registration, no await: a suspend asked
        # meanwhile waits for the save (node/tothend.py).
        networked = self.networks.has_network(sandbox_id)
        keys: builtins.list[str | None] = (
            [*req.idempotency_keys] if req.idempotency_keys else [None] * req.n
        )

        def copy(key: str | None) -> CreateSandbox:
            tags = {**rec.labels, labels.FORKED_FROM: sandbox_id, **fresh_secrets(rec.labels)}
            if key is not None and labels.KEY in tags:
                tags[labels.KEY] = key  # a gateway's key for this copy's row
            return CreateSandbox.model_validate(
                {**rec.spec, "idempotency_key": key, "labels": tags}
            )

        state = self.config.sandboxes_dir / sandbox_id / f"fork-{secrets.token_hex(4)}.state"
        t0 = time.monotonic()
        made_so_far: builtins.list[SandboxInfo] = []

        async def one(key: str | None) -> SandboxInfo:
            info = await self.lifecycle.create(copy(key), state=state, source=sandbox_id)
            made_so_far.append(info)
            return info

        try:
            # To its end, a cancel included: a save stopped half-way had
            # left the source parked with no listener, or frozen, or in
            # CRIU's hands (its exec server refused every later request).
            size = await self.changes.finish(
                sandbox_id, self._snapshot(rec, runtime, state, networked)
            )
            saved = time.monotonic() - t0
            try:
                results = await asyncio.gather(*(one(k) for k in keys), return_exceptions=True)
            except asyncio.CancelledError:
                # All or nothing, a cancel included: the copies made before
                # it landed would run on with ids nobody was given.
                closes = (self.lifecycle.close(i.id, "its fork was cancelled") for i in made_so_far)
                await asyncio.shield(asyncio.gather(*closes, return_exceptions=True))
                raise
        finally:
            # With what the runtime kept beside it (a user's disk's overlay).
            for kept in [state, *state.parent.glob(f"{state.name}.*")]:
                kept.unlink(missing_ok=True)
        made = [r for r in results if isinstance(r, SandboxInfo)]
        failed = [r for r in results if not isinstance(r, SandboxInfo)]
        if failed:
            # All or nothing: a caller asked for n copies of one moment.
            await asyncio.gather(*(self.lifecycle.close(i.id, "its fork failed") for i in made))
            first = failed[0]
            if isinstance(first, CorralError):
                raise first
            raise SandboxFailed(f"sandbox {sandbox_id}: fork failed: {first}") from first
        await reseed_copies(self.config.run_dir, made)
        metrics.VM_OPS.labels("fork").observe(time.monotonic() - t0)
        metrics.VM_STATE_BYTES.labels("fork").inc(size)
        log.info("sandbox.forked", sandbox=sandbox_id, copies=req.n, state_bytes=size,
                 save_ms=round(saved * 1000, 1),
                 ms=round((time.monotonic() - t0) * 1000, 1))  # fmt: skip
        return made

    async def _snapshot(
        self, rec: SandboxRecord, runtime: Snapshottable, state: Path, networked: bool
    ) -> int:
        """A fork's save of its source, which runs on. A checkpoint cannot
        carry a veth whose peer is on the host: a container's is unplugged
        for the dump and plugged back, with the same address, policy and
        learned names (its open connections wait, as for a lost packet). A
        VM's NIC is QEMU's: its source keeps it."""
        unplug = networked and getattr(runtime, "disk_needs_idle", False)
        if unplug:
            assert rec.init_pid is not None
            await self.networks.unplug(rec.id, rec.init_pid)
        try:
            return await runtime.snapshot(rec.id, state)
        finally:
            if unplug:
                assert rec.init_pid is not None
                await self.networks.reconnect(rec.id, rec.init_pid, None)

    # ---------------------------------------------------------------- save, restore

    def _store(self, name: str) -> ObjectStore:
        """One of the stores the operator named, never a path or URL from a
        request; its key (if any) goes to it alone."""
        stores = self.config.object_stores
        url = stores.get(name)
        if url is None:
            raise InvalidArgument(
                "store", f"must name one of this node's stores: {', '.join(sorted(stores))}", name
            )
        if url.startswith("/"):
            Path(url).mkdir(mode=0o700, parents=True, exist_ok=True)
        return open_store(url, self.config.store_keys.get(name))

    async def save(self, sandbox_id: str, req: SaveRequest) -> SavedState:
        """Suspend a sandbox (if it runs) and copy its state and its record
        to an object store, from which restore() starts it on any node with
        the same state version. The sandbox stays here, suspended: resume
        it, or close it once the copy runs elsewhere."""
        rec = self.records.get(sandbox_id)
        runtime = self._snapshottable(rec, "save")
        if is_disk(rec.spec["image"]):
            raise InvalidArgument(
                "image",
                "a sandbox booted from its own disk cannot be saved to a store (its disk and "
                "overlay stay on this node): suspend, resume and fork it here",
                rec.spec["image"],
            )
        store = self._store(req.store)
        for _ in range(5):
            rec = self.records.get(sandbox_id)
            if rec.state == "suspended" and rec.suspended == "disk":
                # No await from this check to the copy's registration: a
                # request's resume waits for the copy (node/tothend.py).
                return await self.changes.run(sandbox_id, self._save(rec, runtime, store, req))
            if rec.state not in ("running", "suspended"):
                break
            await self.suspend(sandbox_id, "disk")
        raise Conflict(f"sandbox {sandbox_id} is {rec.state}, not suspended", sandbox=sandbox_id)

    async def _save(
        self, rec: SandboxRecord, runtime: Snapshottable, store: ObjectStore, req: SaveRequest
    ) -> SavedState:
        """Pack and copy a sandbox suspended to disk. A change of its own:
        a resume meanwhile had removed CRIU's images under the pack, and
        the writes after it had reached the copy."""
        sandbox_id = rec.id
        key = f"{VM_STATES}/{sandbox_id}"
        state = await runtime.saved_state(sandbox_id)
        version = await runtime.state_version()
        t0 = time.monotonic()
        project = rec.labels.get(labels.PROJECT)
        doc = {
            "sandbox": sandbox_id,
            "project": project,
            "kind": rec.kind,
            # The store is read by every node (and an S3 bucket's readers):
            # the source's tokens stay out of it; a restore makes new ones.
            "spec": {**rec.spec, "labels": labels.without_secrets(rec.spec.get("labels") or {})},
            "layers": rec.layers,
            "labels": labels.without_secrets(rec.labels),
            # Its keyed commands' records (a rollout's steps) go along.
            "exec_keys": self.store.exec_keys(sandbox_id),
            "guest": version,
            "state_sha256": await asyncio.to_thread(signing.file_sha256, state),
        }
        record = json.dumps(doc).encode()
        mac = signing.sign(signing.load_key(self.config.state_key_path), key, record)
        await asyncio.to_thread(store.put_file, f"{key}/state", state)
        await asyncio.to_thread(store.put_bytes, f"{key}/saved.json", record)
        await asyncio.to_thread(store.put_bytes, f"{key}/mac", mac.encode())
        size = state.stat().st_size
        metrics.VM_OPS.labels("save").observe(time.monotonic() - t0)
        metrics.VM_STATE_BYTES.labels("save").inc(size)
        log.info("sandbox.saved", sandbox=sandbox_id, bytes=size, store=store.url,
                 ms=round((time.monotonic() - t0) * 1000, 1))  # fmt: skip
        return SavedState(store=req.store, key=key, sandbox=sandbox_id, kind=rec.kind,
                          size=size, guest=version, cpu=float(rec.spec["cpu"]),
                          memory=int(rec.spec["memory"]), project=project)  # fmt: skip

    async def restore(self, req: SavedState) -> SandboxInfo:
        """A new sandbox on this node from a saved state: its memory,
        processes and files as they were saved. The layers are the exact
        ones it was saved with (pulled from the store when this node lacks
        them); the state version must be this node's."""
        store = self._store(req.store)
        try:
            # Read before the signature is checked: bounded (a record holds a
            # spec, labels and its keyed commands' capped output).
            record = await asyncio.to_thread(store.get, f"{req.key}/saved.json", SAVED_MAX)
            mac = (await asyncio.to_thread(store.get, f"{req.key}/mac", 1024)).decode(
                errors="replace"
            )
        except NotFound:
            raise InvalidArgument("key", f"names no saved state in {store.url}", req.key) from None
        if not signing.verify(signing.load_key(self.config.state_key_path), req.key, record, mac):
            raise InvalidArgument(
                "key",
                "must name a state saved by a node sharing this node's state key "
                "(its record's signature does not match)",
                req.key,
            )
        doc = json.loads(record)
        if doc.get("project") != req.project:
            # A state belongs to the project it was saved in: another's looks
            # like none at all (ids cannot be probed across projects).
            raise InvalidArgument("key", f"names no saved state in store {req.store!r}", req.key)
        spec = doc["spec"]
        for name, given, saved in (("cpu", req.cpu, float(spec["cpu"])),
                                   ("memory", req.memory, int(spec["memory"]))):  # fmt: skip
            if given and given != saved:
                # A gateway charged the restore by this value.
                raise InvalidArgument(name, "must be what the state was saved with", given)
        runtime = self.runtimes.get(doc["kind"])
        if not isinstance(runtime, Snapshottable):
            raise InvalidArgument("kind", "this node does not run it", doc["kind"])
        here = await runtime.state_version()
        if doc["guest"] != here:
            raise InvalidArgument(
                "guest",
                f"must match this node's guest artefacts ({here}): a state loads only into the "
                "kernel it was saved under",
                doc["guest"],
            )
        for digest in doc["layers"]:
            try:
                self.layers.store.get(digest)
            except ImageNotFound:
                await asyncio.to_thread(registry.pull, self.layers.store, digest, store, _quiet)
        spec, layers = dict(doc["spec"]), list(doc["layers"])
        # Exactly the saved layers, by digest: a tag may name another layer here.
        spec["image"] = layers.pop(0)
        if spec.get("workspace"):
            spec["workspace"] = layers.pop(0)
        spec["toolkit"] = layers
        tags = {
            **doc["labels"],
            labels.RESTORED_FROM: doc["sandbox"],
            **fresh_secrets(doc["labels"]),
        }
        if req.idempotency_key is not None and labels.KEY in tags:
            tags[labels.KEY] = req.idempotency_key
        spec.update(labels=tags, idempotency_key=req.idempotency_key)
        local = self.config.sandboxes_dir / f".restore-{secrets.token_hex(6)}.state"
        try:
            await asyncio.to_thread(_download, store, f"{req.key}/state", local)
            # Checked before the runtime reads a byte of it (signing.py says why).
            if await asyncio.to_thread(signing.file_sha256, local) != doc["state_sha256"]:
                raise InvalidArgument(
                    "key", "its state file does not match its signed record", req.key
                )
            t0 = time.monotonic()
            info = await self.lifecycle.create(CreateSandbox.model_validate(spec), state=local)
            self.store.import_exec_keys(info.id, [tuple(r) for r in doc.get("exec_keys", [])])
            # Its source may live on (resumed where it was saved): two copies.
            await reseed_copies(self.config.run_dir, [info])
            metrics.VM_OPS.labels("restore").observe(time.monotonic() - t0)
            return info
        finally:
            local.unlink(missing_ok=True)
