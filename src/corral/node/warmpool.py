"""Warm sandboxes: containers started ahead of demand, per image stack, so
that a create claims one in milliseconds instead of waiting for crun.

A warm sandbox is an ordinary container sandbox, started by the ordinary
create path with every defence of a cold one (user namespace, seccomp,
masks, read-only platform layer) and labelled corral.pool=warm: hidden
from listings, refused to the sandbox API, retired with its agent. A
create whose kind is container and whose layers (by digest) match a warm
sandbox claims it: admission makes its record the claimant's (budgets,
idempotency key, labels, spec) in one transaction, then the claimant's
ceilings, disk quota, CPU class and network are applied (node/lifecycle.py
claim). A warm sandbox has run nothing of anyone's, so a claimed one is
indistinguishable from a cold one; none is ever handed out twice. A
container desktop is warm once drawn (its session started as a cold
create starts it), keyed by its screen size too, and checked to still
show itself when claimed.

Sizing follows demand: each stack keeps as many warm sandboxes as it was
asked for in the last WINDOW seconds, all stacks together at most
`warm_pool` (the node's setting; 0: off); a stack not asked for in
FORGET_AFTER seconds gives its warm sandboxes back. One background task
refills, one sandbox at a time, neediest stack first.
"""

from __future__ import annotations

import asyncio
import io
import time
from collections import deque

from corral import labels
from corral.api.models import CreateSandbox, SandboxInfo
from corral.config import NodeConfig
from corral.errors import CorralError, NodeFull, SandboxFailed
from corral.log import get_logger
from corral.node.admission import WARM, NotWarm
from corral.node.lifecycle import Lifecycle

log = get_logger("corral.node")

WINDOW = 60.0
FORGET_AFTER = 300.0
STOP_WAIT = 30.0  # seconds a cancelled refill has to end at aclose
Stack = tuple[str, ...]  # layer digests, base first


class WarmPool:
    def __init__(self, config: NodeConfig, lifecycle: Lifecycle) -> None:
        self.size = config.warm_pool
        self.lifecycle = lifecycle
        self._ready: dict[Stack, deque[str]] = {}
        self._making: dict[Stack, int] = {}
        self._asked: dict[Stack, deque[float]] = {}
        self._template: dict[Stack, CreateSandbox] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def _stack(self, req: CreateSandbox) -> Stack | None:
        if self.size <= 0 or req.kind != "container":
            return None
        try:
            stack = tuple(layer.digest for layer in self.lifecycle.resolve_layers(req))
        except CorralError:
            return None  # not here yet (a registry's, a source's): the cold path fetches it
        if req.display_size is not None:
            # A desktop's session is started at create, on a screen of
            # its size: a warm desktop is drawn, and only for that size.
            w, h = req.display_size
            stack = (*stack, f"display={w}x{h}")
        return stack

    async def claim(self, req: CreateSandbox) -> SandboxInfo | None:
        """A warm sandbox made into `req`'s, or None (create it cold)."""
        stack = self._stack(req)
        if stack is None:
            return None
        self._note(stack, req)
        if self.lifecycle.admission.earlier(req.idempotency_key) is not None:
            return None  # the cold path returns what the key made
        ready = self._ready.get(stack)
        while ready:
            sandbox_id = ready.popleft()
            self._wake.set()  # one fewer: refill
            try:
                return await self.lifecycle.claim(sandbox_id, req)
            except NotWarm:
                continue
            except SandboxFailed as exc:  # a warm desktop whose session died: closed
                log.warning("warm_pool.claim_failed", sandbox=sandbox_id, error=exc.message)
                continue
            except NodeFull:
                ready.appendleft(sandbox_id)  # still warm; a cold create needs more
                raise
        return None

    def expect(self, req: CreateSandbox, n: int) -> None:
        """Count `n` asks for `req`'s stack now: the pool grows toward n
        (up to its size) ahead of a burst the caller knows is coming."""
        stack = self._stack(req)
        for _ in range(n if stack is not None else 0):
            self._note(stack, req)  # type: ignore[arg-type]

    def _note(self, stack: Stack, req: CreateSandbox) -> None:
        now = time.monotonic()
        asked = self._asked.setdefault(stack, deque())
        asked.append(now)
        while asked and asked[0] < now - WINDOW:
            asked.popleft()
        if stack not in self._template:
            # What is fixed when a sandbox starts (its layers), with sizes
            # a claim changes; nothing of the caller's (labels, env,
            # network, key) goes into a warm sandbox.
            self._template[stack] = req.model_copy(
                update={
                    "labels": {labels.POOL: WARM}, "env": {}, "network": None,
                    "idempotency_key": None, "protected": [], "ttl": None,
                    "idle_timeout": None, "cpu_class": "interactive",
                }
            )  # fmt: skip
        self._wake.set()
        if self._task is None:
            self._task = asyncio.create_task(self._fill())

    def _wanted(self, stack: Stack) -> int:
        now = time.monotonic()
        return min(self.size, sum(1 for t in self._asked.get(stack, ()) if t >= now - WINDOW))

    def held(self) -> int:
        return sum(len(q) for q in self._ready.values()) + sum(self._making.values())

    def _neediest(self) -> Stack | None:
        if self.held() >= self.size:
            return None
        short = {
            s: self._wanted(s) - len(self._ready.get(s, ())) - self._making.get(s, 0)
            for s in self._template
        }
        best = max(short, key=lambda s: short[s], default=None)
        return best if best is not None and short[best] > 0 else None

    async def _fill(self) -> None:
        me = asyncio.current_task()
        while True:
            # A cancel that a create dropped is still this task's: without
            # this check the loop went back to waiting for demand and a
            # stopping agent waited on it (seen in a bench run: the refill
            # "cancelling", parked at the wait below). asyncio.wait_for on
            # Python 3.11 was what dropped it (now banned, pyproject.toml);
            # the check stays for whatever else may.
            if me is not None and me.cancelling():
                raise asyncio.CancelledError
            await self._wake.wait()
            self._wake.clear()
            await self._forget_stale()
            while (stack := self._neediest()) is not None:
                self._making[stack] = self._making.get(stack, 0) + 1
                try:
                    info = await self.lifecycle.create(self._template[stack])
                except CorralError as exc:  # full, or the image went: ask again later
                    log.info("warm_pool.not_refilled", error=exc.message)
                    break
                except Exception:  # a bug must not end refilling for good
                    log.error("warm_pool.refill_failed", exc=True)
                    break
                finally:
                    self._making[stack] -= 1
                self._ready.setdefault(stack, deque()).append(info.id)

    async def _forget_stale(self) -> None:
        """Stacks nobody asked for in FORGET_AFTER give their sandboxes back."""
        now = time.monotonic()
        for stack, asked in list(self._asked.items()):
            if asked and asked[-1] >= now - FORGET_AFTER:
                continue
            for sandbox_id in self._ready.pop(stack, deque()):
                await self._close(sandbox_id)
            self._asked.pop(stack, None)
            self._template.pop(stack, None)

    async def _close(self, sandbox_id: str) -> None:
        # One that will not close must not keep the rest of the pool alive
        # (aclose closes them one after another).
        try:
            await self.lifecycle.retire(sandbox_id, "a warm sandbox given back")
        except CorralError:
            pass  # closed meanwhile
        except Exception:
            log.error("warm_pool.close_failed", sandbox=sandbox_id, exc=True)

    async def aclose(self) -> None:
        """Stop refilling and close every warm sandbox (none is handed out).
        A refill that does not end within STOP_WAIT of its cancel is left
        behind, its stack logged: the warm sandboxes are closed all the same
        (a pool of 64 was once found running after its agent was told to
        stop, every one still in the pool, and nothing said why)."""
        if self._task is not None:
            task, self._task = self._task, None
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=STOP_WAIT)
            if not done:
                stack = io.StringIO()
                task.print_stack(file=stack)
                log.error(
                    "warm_pool.refill_did_not_stop", waited_s=STOP_WAIT, stack=stack.getvalue()
                )
            elif not task.cancelled() and task.exception() is not None:
                log.error("warm_pool.refill_failed", error=repr(task.exception()))
        for ready in self._ready.values():
            while ready:
                await self._close(ready.popleft())
        self._ready.clear()
