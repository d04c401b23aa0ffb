"""A sandbox's writable layer (what it changed over its image) as a new
image layer: how a toolkit or workspace is built by a script or an agent.
Taken from a read-only btrfs snapshot, so the sandbox may keep running."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

from corral import labels as platform_labels
from corral.api.models import CommitRequest, LayerInfo
from corral.config import NodeConfig
from corral.errors import InvalidArgument
from corral.host.scratch import Scratch
from corral.images.build import build_from_dir
from corral.images.layer import STACK, ImageConfig, Layer
from corral.images.store import SOURCE, ImageStore
from corral.log import get_logger
from corral.node.admission import Admission
from corral.node.store import SandboxRecord, Store
from corral.runtimes.container.bundle import IDS

log = get_logger("corral.node")


def layer_info(layer: Layer, in_use: bool = False) -> LayerInfo:
    return LayerInfo(
        digest=layer.digest,
        names=layer.names,
        kind=layer.kind,
        parent=layer.parent,
        content_size=layer.content_size,
        meta_size=layer.meta_size,
        blob_size=layer.blob_size,
        chunk_size=layer.chunk_size,
        created=layer.created,
        labels=layer.labels,
        in_use=in_use,
    )


class Commits:
    def __init__(
        self,
        config: NodeConfig,
        store: Store,
        images: ImageStore,
        scratch: Scratch,
        admission: Admission,
        nsexec: Path,
    ) -> None:
        self.config = config
        self.store = store
        self.images = images
        self.scratch = scratch
        self.admission = admission
        self.nsexec = nsexec

    async def commit(self, rec: SandboxRecord, req: CommitRequest) -> LayerInfo:
        sandbox_id = rec.id
        if req.stack and (rec.spec.get("workspace") or rec.spec.get("toolkit")):
            # The new layer sits on the image alone: a workspace or toolkit
            # under it would silently drop out of the image it makes.
            raise InvalidArgument(
                "stack", "needs a sandbox with no workspace or toolkit", sandbox_id
            )
        db = self.store
        snap = f".commit-{sandbox_id}-{secrets.token_hex(4)}"
        db.add_resource(sandbox_id, "subvolume", snap)  # recorded before made
        try:
            path = await asyncio.to_thread(self.scratch.snapshot, sandbox_id, snap)
            src, wrap = path / "upper", None
            base = self.admission.host_id(sandbox_id)
            if base is not None:
                # The upper holds the sandbox's host ids: read it through a
                # view that shifts them back, so the layer is root's again.
                stage = self.config.sandboxes_dir / sandbox_id / "stage"
                stage.mkdir(mode=0o700, exist_ok=True)
                src = stage / "commit"
                src.mkdir(exist_ok=True)
                wrap = [str(self.nsexec), "--view", str(path / "upper"), str(src),
                        f"{base} 0 {IDS}", "--"]  # fmt: skip
            labels = {**req.labels, SOURCE: f"commit:{sandbox_id}"}
            project = rec.labels.get(platform_labels.PROJECT)
            if project is not None:  # a gateway's: that project's alone (ImageStore.for_project)
                labels[platform_labels.PROJECT] = project
            if req.stack:
                labels[STACK] = "commit"
            config = ImageConfig(env=list(req.env), workdir=req.workdir, user=req.user)
            layer = await asyncio.to_thread(
                build_from_dir,
                self.images,
                src,
                tag=req.tag,
                kind=req.kind,
                config=config,
                parent=rec.layers[-1],
                labels=labels,
                wrap=wrap,
                measure=path / "upper",
            )
        finally:
            await asyncio.to_thread(self.scratch.destroy, snap)
            db.drop_resource(sandbox_id, "subvolume", snap)
        log.info("layer.committed", sandbox=sandbox_id, digest=layer.digest, tag=req.tag)
        return layer_info(layer)
