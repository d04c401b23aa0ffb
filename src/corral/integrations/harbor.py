"""A harbor environment provider (`pip install corral[harbor]`; harbor
needs Python 3.12): harbor's trials, terminal-bench's included, run in
Corral sandboxes.

    harbor run -p TASKS -a oracle -e corral.integrations.harbor:CorralEnvironment -n 32

The server is CORRAL_URL (and CORRAL_API_KEY), or an embedded node. start()
builds the task's environment/Dockerfile with Corral's builder (each step a
sandbox and a cached layer: one build per image however many trials start
at once) and starts a sandbox on it with the task's cpus, memory, storage
and network mode (`no-network`: loopback only; `allowlist`: its hosts;
`public`: the package ecosystems and code hosts, Corral having no policy
for "anywhere"). exec, the file transfers and stop() map to the sandbox.
"""

from __future__ import annotations

import asyncio
import io
import os
import tarfile
from pathlib import Path
from typing import Any

from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.environments.capabilities import EnvironmentCapabilities

from corral.build.builder import Builder, Options
from corral.errors import CommandTimeout, CorralError
from corral.integrations.connect import client as connect
from corral.sdk.client import AsyncClient
from corral.sdk.sandbox import AsyncSandbox
from corral.tasks.runner import PUBLIC, tar_dir

_clients: dict[int, AsyncClient] = {}  # one per event loop
_builds: dict[str, asyncio.Task[None]] = {}


def _client() -> AsyncClient:
    loop = id(asyncio.get_running_loop())
    if loop not in _clients:
        _clients[loop] = connect()
    return _clients[loop]


class CorralEnvironment(BaseEnvironment):  # type: ignore[misc]
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.sandbox: AsyncSandbox | None = None
        super().__init__(*args, **kwargs)

    @staticmethod
    def type() -> str:
        return "corral"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        return EnvironmentCapabilities(disable_internet=True, network_allowlist=True,
                                       network_allowlist_hostnames=True,
                                       network_allowlist_wildcard_hostnames=True)  # fmt: skip

    def _validate_definition(self) -> None:
        if not (Path(self.environment_dir) / "Dockerfile").is_file():
            raise FileNotFoundError(f"{self.environment_dir}/Dockerfile: Corral builds from it")

    @property
    def _image(self) -> str:
        safe = "".join(c if c.isalnum() or c in "._-" else "-" for c in self.environment_name)
        return f"harbor-{safe.lower().strip('-.')[:100] or 'task'}:latest"

    def _network(self) -> dict[str, Any] | None:
        cfg = self.task_env_config
        mode = str(getattr(cfg.network_mode, "value", cfg.network_mode))
        if mode == "no-network":
            return None
        if mode == "allowlist":
            return {"domains": list(cfg.allowed_hosts)}
        return dict(PUBLIC)

    async def _build(self, force: bool) -> None:
        key = f"{self.environment_dir}"
        task = _builds.get(key)
        if task is None or force:
            dockerfile = Path(self.environment_dir) / "Dockerfile"
            opts = Options(self._image, no_cache=force,
                           step_timeout=float(self.task_env_config.build_timeout_sec))  # fmt: skip
            builder = Builder(_client(), Path(self.environment_dir), opts)

            async def build() -> None:
                await builder.build(dockerfile.read_text())

            task = _builds[key] = asyncio.get_running_loop().create_task(build())
        try:
            await asyncio.shield(task)
        except BaseException:
            _builds.pop(key, None)  # a later trial tries again
            raise

    async def start(self, force_build: bool) -> None:
        await self._build(force_build)
        cfg = self.task_env_config
        fields: dict[str, Any] = {
            "image": self._image, "network": self._network(), "idle_timeout": None,
            "ttl": 24 * 3600, "labels": {"harbor.session": self.session_id[:63]},
        }  # fmt: skip
        if cfg.cpus:
            fields["cpu"] = float(cfg.cpus)
        if cfg.memory_mb:
            fields["memory"] = int(cfg.memory_mb) * 2**20
        if cfg.storage_mb:
            fields["disk"] = int(cfg.storage_mb) * 2**20
        self.sandbox = await _client().sandboxes.create(**fields)
        await self.ensure_dirs(self._mount_targets(writable_only=True))

    async def stop(self, delete: bool) -> None:
        if self.sandbox is not None:
            await self.sandbox.close()  # a sandbox is never kept: its image is
            self.sandbox = None

    def _box(self) -> AsyncSandbox:
        if self.sandbox is None:
            raise RuntimeError("the environment is not started")
        return self.sandbox

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        who = self._resolve_user(user)
        try:
            r = await self._box().commands.run(
                command, cwd=cwd or self.task_env_config.workdir, env=self._merge_env(env),
                user=None if who is None else str(who), timeout=timeout_sec or None,
            )  # fmt: skip
        except CommandTimeout as exc:
            raise TimeoutError(exc.message) from exc
        return ExecResult(stdout=r.stdout, stderr=r.stderr, return_code=r.exit_code)

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        data = Path(source_path).read_bytes()
        await self._box().files.write(target_path, data, mode=os.stat(source_path).st_mode & 0o777)

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        await self._box().files.upload_tar(target_dir, tar_dir(Path(source_dir)))

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        Path(target_path).parent.mkdir(parents=True, exist_ok=True)
        Path(target_path).write_bytes(await self._box().files.read(source_path))

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        try:
            data = await self._box().files.download_tar(source_dir)
        except CorralError as exc:
            raise FileNotFoundError(f"{source_dir}: {exc.message}") from exc
        target = Path(target_dir)
        target.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            tar.extractall(target, filter="data")
