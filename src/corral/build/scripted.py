"""A toolkit layer built by a script inside a Corral sandbox, the way a user
would build it: the script's folder is written into a sandbox of the base
(whose network reaches the package sources the spec opens and nothing
else), the script runs as root, and what it leaves under / is committed.
The layer is labelled with a key of its inputs, so it is built once and
found again (`ensure`).

The script reports progress with lines "step: WHAT"; the spec says how
many to expect. The build trusts what this host trusts: behind a
TLS-inspecting proxy, downloads verify only with the host's CAs, so the
host's bundle is written to /tmp (which the script empties: the layer
keeps none) and named by the usual variables.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from corral.errors import Unavailable
from corral.images.layer import Layer
from corral.images.store import ImageStore, ProgressFn

HOST_CA = "/etc/ssl/certs/ca-certificates.crt"
CA_IN_SANDBOX = "/tmp/host-ca.pem"
CA_VARS = ("NODE_EXTRA_CA_CERTS", "npm_config_cafile", "SSL_CERT_FILE")


@dataclass(frozen=True)
class ScriptedToolkit:
    tag: str
    base: str
    files: Path  # written, whole, under `home` in the sandbox
    home: str
    script: str  # in `files`
    args: tuple[str, ...]
    key: str  # of every input: a change builds again
    label: str  # the label that holds the key
    steps: int
    ecosystems: tuple[str, ...]
    toolkit: tuple[str, ...] = ()
    memory: int = 4 * 2**30
    disk: int = 16 * 2**30
    timeout: float = 5400.0


class _Lines:
    """Chunks of a stream in, whole lines out."""

    def __init__(self, each: Callable[[str], None]) -> None:
        self.each = each
        self.part = ""

    def __call__(self, chunk: str) -> None:
        *whole, self.part = (self.part + chunk).split("\n")
        for text in whole:
            self.each(text)

    def flush(self) -> None:
        if self.part:
            self.each(self.part)
            self.part = ""


def ensure(spec: ScriptedToolkit, store: ImageStore, data_dir: Path, progress: ProgressFn) -> Layer:
    """The layer labelled with the spec's key (tagged again), or a new one."""
    layer = store.find_by_label(spec.label, spec.key)
    if layer is not None:
        store.tag(layer.digest, spec.tag)
        return layer
    return asyncio.run(_build(spec, store, data_dir, progress))


async def _build(
    spec: ScriptedToolkit, store: ImageStore, data_dir: Path, progress: ProgressFn
) -> Layer:
    from corral.sdk.client import AsyncClient

    name = spec.tag.partition(":")[0]
    async with AsyncClient(data_dir=data_dir) as client:
        sbx = await client.sandboxes.create(
            image=spec.base,
            toolkit=list(spec.toolkit),
            network={"ecosystems": dict.fromkeys(spec.ecosystems, True)},
            memory=spec.memory,
            disk=spec.disk,
            cpu=2,
            ttl=int(spec.timeout) + 1800,
            idle_timeout=None,
            labels={"corral.build": spec.tag},
        )
        try:
            for f in sorted(p for p in spec.files.rglob("*") if p.is_file()):
                rel = f.relative_to(spec.files)
                await sbx.files.write(f"{spec.home}/{rel}", f.read_bytes(), mode=0o755)
            steps = 0
            lines: list[str] = []

            def line(text: str) -> None:
                nonlocal steps
                lines[:] = [*lines[-40:], text]
                if text.startswith("step: "):
                    steps += 1
                    progress(f"{name}: {text[6:][:60]}", steps, spec.steps)

            # Output comes in chunks, not lines: each stream keeps its part line.
            out, err = _Lines(line), _Lines(line)

            env: dict[str, Any] = {}
            if Path(HOST_CA).is_file():
                await sbx.files.write(CA_IN_SANDBOX, Path(HOST_CA).read_bytes())
                env = dict.fromkeys(CA_VARS, CA_IN_SANDBOX)
            r = await sbx.commands.run(
                ["bash", f"{spec.home}/{spec.script}", *spec.args],
                timeout=spec.timeout,
                on_stdout=out,
                on_stderr=err,
                env=env,
            )
            out.flush()
            err.flush()
            if r.exit_code != 0:
                raise Unavailable(f"the build of {spec.tag} failed: {chr(10).join(lines)[-2000:]}")
            info = await sbx.commit(spec.tag, kind="toolkit", labels={spec.label: spec.key})
        finally:
            await sbx.close()
    return store.get(info.digest)
