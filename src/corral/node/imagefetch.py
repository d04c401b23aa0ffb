"""Images a node lacks, fetched on first use (docs/image-distribution.md).

Two kinds of reference can be fetched: a registry reference
(`host/name:tag`, pulled with skopeo and converted, images/pull.py), and
a Corral reference (`name:tag` or a layer digest) that one of the node's
`image_sources` holds: a shared blob store (a directory, `corral blobd`,
S3). From a blob store only the tag and the manifests are copied; the
metadata image comes at first mount and the data chunk by chunk as
sandboxes read it (images/registry.py records each layer's origin).

Single flight: however many creates ask for one reference at once, it is
fetched once; the others wait on that fetch (shielded, so a create that
is cancelled does not cancel the fetch the others wait on).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from corral import metrics, trace
from corral.errors import CorralError, ImageNotFound, InvalidArgument, Unavailable
from corral.images import registry
from corral.images.egress import PullGuard
from corral.images.layer import Layer, RegistryRef
from corral.images.objects import LocalObjects, ObjectStore, open_store, operator_key
from corral.images.pull import pull
from corral.images.store import ImageStore
from corral.log import get_logger

log = get_logger("corral.node")


def _quiet(task: str, done: float, total: float | None) -> None:
    """Progress of a fetch a create waits on: its log line says when it ends."""


class ImageFetcher:
    def __init__(
        self, images: ImageStore, sources: list[str], guard: list[str] | None = None
    ) -> None:
        """`guard`: registry pulls go through a PullGuard that also denies
        these networks (the cluster's own hosts); None: unguarded."""
        self.images = images
        self.sources = list(sources)
        self.guard = guard
        self._flights: dict[str, asyncio.Task[Layer | None]] = {}

    async def ensure(self, ref: str, field: str) -> None:
        """Make `ref` resolvable in the node's store, fetching it if it is
        missing and some source has it; a reference no source has is left
        for resolve() to refuse (with the field named)."""
        remote = RegistryRef.parse(ref)
        if remote is None and not self.sources:
            return
        try:
            self.images.digest_of(ref, field)
            return
        except ImageNotFound:
            pass
        except CorralError:
            return  # malformed: resolve() names the field and the rule
        key = str(remote) if remote is not None else ref
        flight = self._flights.get(key)
        if flight is None:
            flight = asyncio.get_running_loop().create_task(self._fetch(ref, field, remote))
            self._flights[key] = flight
            flight.add_done_callback(lambda _: self._flights.pop(key, None))
        try:
            await asyncio.shield(flight)
        except InvalidArgument as exc:
            if exc.field != "ref":
                raise
            # A pull names the reference's rule; a create, its field.
            raise InvalidArgument(field, exc.rule, exc.value) from None

    async def _fetch(self, ref: str, field: str, remote: RegistryRef | None) -> Layer | None:
        t0 = time.monotonic()
        with trace.span("image.pull", **{"image.ref": ref}):
            try:
                if remote is not None:
                    layer = await asyncio.to_thread(self._pull, ref)
                    source = remote.host
                else:
                    layer, source = await asyncio.to_thread(self._from_sources, ref, field)
            except CorralError:
                metrics.IMAGE_FETCHES.labels("failed").inc()
                raise
        metrics.IMAGE_FETCHES.labels("fetched").inc()
        log.info("image.pulled", ref=ref, digest=layer.digest, source=source,
                 seconds=round(time.monotonic() - t0, 3))  # fmt: skip
        return layer

    def _pull(self, ref: str) -> Layer:
        if self.guard is None:
            return pull(self.images, ref, _quiet)
        with PullGuard(self.guard) as guard:
            return pull(self.images, ref, _quiet, guard=guard)

    def _from_sources(self, ref: str, field: str) -> tuple[Layer, str]:
        """The first source that has `ref`. A source that cannot be read is
        skipped, and named in the error if none has it."""
        problems: list[str] = []
        for i, url in enumerate(self.sources):
            try:
                store = self._open(url)
                return registry.pull(self.images, ref, store, _quiet), url
            except ImageNotFound as exc:
                if any(w in exc.message for w in ("does not match", "missing", "is damaged")):
                    raise ImageNotFound(
                        f"{field} '{ref}' in image_sources[{i}] ({url}) is damaged: {exc.message}",
                        field=field,
                        ref=ref,
                    ) from None
                problems.append(f"image_sources[{i}] {url}: not there")
            except CorralError as exc:
                problems.append(f"image_sources[{i}] {url}: {exc.message}")
        raise ImageNotFound(
            f"{field} '{ref}' is not on this node nor in its image sources ("
            + "; ".join(problems)
            + "); push it with `corral image push REF STORE`",
            field=field,
            ref=ref,
        )

    @staticmethod
    def _open(url: str) -> ObjectStore:
        store = open_store(url, operator_key() if url.startswith("http") else None)
        if isinstance(store, LocalObjects) and not (Path(url) / "layers").is_dir():
            # A typo'd path reads as an empty store; say what it is instead.
            raise Unavailable("is not a blob store (it has no layers/ directory)")
        return store
