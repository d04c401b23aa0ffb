"""Builds the function calls' toolchains (images/toolchains.py): the
toolchains layer in a sandbox, through the SDK, and the runners' layer.

    python -m corral.cli.toolchains    (the install script runs it)
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from corral.errors import Unavailable
from corral.images.layer import Layer
from corral.images.store import ImageStore, ProgressFn
from corral.images.toolchains import (
    BASE,
    CA_IN_SANDBOX,
    DEBIAN,
    ECOSYSTEMS,
    FILES,
    HOME,
    HOST_CA,
    LABEL,
    RUNNERS_TAG,
    TAG,
    build_runners,
    key,
)
from corral.sdk.client import AsyncClient


async def _build(store: ImageStore, data_dir: Path, progress: ProgressFn) -> Layer:
    async with AsyncClient(data_dir=data_dir) as client:
        sbx = await client.sandboxes.create(
            image=BASE,
            network={"ecosystems": ECOSYSTEMS},
            memory=4 * 2**30,
            disk=16 * 2**30,
            cpu=2,
            ttl=7200,
            idle_timeout=None,
            labels={"corral.build": TAG},
        )
        try:
            for f in sorted(p for p in FILES.rglob("*") if p.is_file()):
                rel = f.relative_to(FILES)
                await sbx.files.write(f"{HOME}/{rel}", f.read_bytes(), mode=0o755)
            steps = 0
            lines: list[str] = []

            def out(text: str) -> None:
                nonlocal steps
                for line in text.splitlines():
                    lines[:] = [*lines[-40:], line]
                    if line.startswith("step: "):
                        steps += 1
                        progress(f"toolchains: {line[6:][:60]}", steps, 5)

            # The build trusts what this host trusts: behind a TLS-inspecting
            # proxy npm's downloads verify only with the host's CAs.
            # It lives in /tmp, which build.sh empties: the layer keeps none.
            # A host without the bundle: the image's own CAs, as npm ships them.
            env: dict[str, str] = {}
            if Path(HOST_CA).is_file():
                await sbx.files.write(CA_IN_SANDBOX, Path(HOST_CA).read_bytes())
                env = {
                    "NODE_EXTRA_CA_CERTS": CA_IN_SANDBOX,
                    "npm_config_cafile": CA_IN_SANDBOX,
                    "SSL_CERT_FILE": CA_IN_SANDBOX,
                }
            r = await sbx.commands.run(
                ["bash", f"{HOME}/build.sh", *DEBIAN],
                timeout=5400,
                on_stdout=out,
                on_stderr=out,
                env=env,
            )
            if r.exit_code != 0:
                raise Unavailable(f"the toolchains' build failed: {chr(10).join(lines)[-2000:]}")
            info = await sbx.commit(TAG, kind="toolkit", labels={LABEL: key()})
        finally:
            await sbx.close()
    return store.get(info.digest)


def build(store: ImageStore, data_dir: Path, progress: ProgressFn) -> Layer:
    """The toolchains' layer: found again by its key, or built."""
    layer = store.find_by_label(LABEL, key())
    if layer is not None:
        store.tag(layer.digest, TAG)
        return layer
    return asyncio.run(_build(store, data_dir, progress))


if __name__ == "__main__":
    from corral.config import NodeConfig
    from corral.progress import progress_bar

    cfg = NodeConfig.from_env()
    with progress_bar() as bar:
        store = ImageStore(cfg.images_dir)
        built = [build(store, cfg.data_dir, bar), build_runners(store, bar)]
    for tag, layer in zip((TAG, RUNNERS_TAG), built, strict=True):
        print(f"{tag} {layer.digest} ({layer.content_size / 2**20:.1f} MiB)")
