"""Build an image from a Dockerfile, each step in a Corral sandbox
(docs/dockerfile.md).

A stage starts from its FROM image (a Corral image, a registry reference
the node pulls, or an earlier stage). RUN runs in a sandbox on the image
so far, under the build's network policy (package ecosystems open: the
setup phase of DSec's "open during setup, closed during the task"); COPY
and ADD upload from the context (or, `--from`, from another stage's
image); each becomes a layer by commit, stacked on the one before
(`commit(stack=True)`), carrying the image config so far. ENV, ARG,
WORKDIR, USER, SHELL and LABEL change the config; CMD, ENTRYPOINT and the
other metadata are recorded as labels. The last stage's image is tagged.

Each layer-making step is cached by content: the image it starts from (by
digest), the instruction, the config it runs under, and for COPY the
names, modes and bytes of what it copies. A rebuild after a change to one
step runs that step and those after it, and finds the others again
(`list_layers` by the `build.key` label).
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import io
import json
import posixpath
import re
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from corral.api.models import LayerInfo
from corral.build.context import Context
from corral.build.dockerfile import Instruction, Stage, env_pairs, parse, substitute
from corral.errors import CorralError, InvalidArgument
from corral.images.layer import RegistryRef
from corral.sdk.client import AsyncClient
from corral.sdk.sandbox import AsyncSandbox

HOST_CA = "/etc/ssl/certs/ca-certificates.crt"
CA_IN_SANDBOX = "/tmp/.corral-build-ca.pem"
CA_VARS = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "PIP_CERT", "CURL_CA_BUNDLE",
           "NODE_EXTRA_CA_CERTS", "npm_config_cafile")  # fmt: skip
BUILD_NETWORK: dict[str, Any] = {"ecosystems": {"pypi": True, "debian": True, "npm": True}}
KEY = "build.key"
_HOSTS = re.compile(
    r"(?:resolve host:? |resolving '|host='|Failed to connect to |connect to host |Name or service "
    r"not known[^\n]*?|unable to resolve host address ')([A-Za-z0-9.-]+\.[A-Za-z]{2,})"
)
Output = Callable[[str], None]
# What a step's output says when the network refused it.
_NET_TROUBLE = re.compile(
    r"resolv|name or service not known|getaddrinfo|name resolution|could not connect|"
    r"connection refused|network is unreachable|failed to establish",
    re.IGNORECASE,
)


@dataclass
class State:
    """The image so far and the config its next step runs under."""

    ref: str
    digest: str = ""
    env: dict[str, str] = field(default_factory=dict)
    args: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    user: str | None = None
    shell: list[str] = field(default_factory=lambda: ["/bin/sh", "-c"])
    labels: dict[str, str] = field(default_factory=dict)

    def vars(self) -> dict[str, str]:
        return {**self.args, **self.env}

    def env_list(self) -> list[str]:
        return [f"{k}={v}" for k, v in self.env.items()]


@dataclass
class StepReport:
    line: int
    text: str
    cached: bool
    seconds: float
    digest: str


@dataclass
class BuildResult:
    image: LayerInfo
    steps: list[StepReport]


@dataclass
class Options:
    tag: str
    build_args: dict[str, str] = field(default_factory=dict)
    network: dict[str, Any] = field(default_factory=lambda: dict(BUILD_NETWORK))
    no_cache: bool = False
    step_timeout: float = 3600.0
    # RUN steps trust what the host trusts (a TLS-inspecting proxy's root):
    # its CA bundle is put in /tmp for the step and the usual variables point
    # at it; it is removed before the commit, so no layer keeps it.
    host_ca: str | None = HOST_CA
    sandbox: dict[str, Any] = field(
        default_factory=lambda: {"cpu": 1.0, "memory": "2GiB", "disk": "8GiB"}
    )


class Builder:
    def __init__(self, client: AsyncClient, context: Path, opts: Options,
                 on_step: Callable[[int, int, str], None] | None = None,
                 on_output: Output | None = None) -> None:  # fmt: skip
        self.client = client
        self.ctx = Context.open(context)
        self.opts = opts
        self.on_step = on_step or (lambda i, n, text: None)
        self.on_output = on_output
        self.steps: list[StepReport] = []
        self._names: dict[str, str] | None = None

    # ------------------------------------------------------------ the image

    async def _digest(self, ref: str) -> str:
        """The digest `ref` names on the node (a registry image is pulled
        by a first sandbox on it)."""
        if ref.startswith("sha256:"):
            return ref
        remote = RegistryRef.parse(ref)
        want = f"{remote.local_name}:{remote.local_tag}" if remote else ref
        want = want if ":" in want.split("/")[-1] else want + ":latest"
        for attempt in range(2):
            service = await self.client._ready()
            for layer in await service.list_layers():
                if want in layer.names:
                    return layer.digest
            if attempt == 0 and remote is not None:
                sbx = await self.client.sandboxes.create(image=ref, ttl=600)
                await sbx.close()
        raise InvalidArgument("dockerfile", "FROM names an image this node does not have", ref)

    async def _sandbox(self, st: State, network: bool) -> AsyncSandbox:
        return await self.client.sandboxes.create(
            image=st.digest, network=self.opts.network if network else None,
            ttl=self.opts.step_timeout + 600, idle_timeout=None,
            labels={"build": self.opts.tag.replace(":", "_")[:63]}, **self.opts.sandbox,
        )  # fmt: skip

    async def _cached(self, key: str) -> LayerInfo | None:
        if self.opts.no_cache:
            return None
        service = await self.client._ready()
        found = await service.list_layers({KEY: key})
        return found[0] if found else None

    async def _commit(self, sbx: AsyncSandbox, st: State, key: str, step: Instruction,
                      tag: str | None = None) -> LayerInfo:  # fmt: skip
        labels = {KEY: key, "build.line": str(step.line)} if key else dict(st.labels)
        return await sbx.commit(
            tag or f"build-cache/{key[:24]}:1", kind="base", stack=True, env=st.env_list(),
            workdir=st.workdir, user=st.user, labels=labels,
        )  # fmt: skip

    # ------------------------------------------------------------ the steps

    def _key(self, st: State, step: Instruction, extra: str = "") -> str:
        run = step.raw if step.kind == "RUN" else ""
        doc = [st.digest, step.kind, step.args, run, sorted(step.flags.items()), st.env,
               st.args, st.workdir, st.user, st.shell, extra]  # fmt: skip
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()

    async def _run(self, st: State, step: Instruction, sbx: AsyncSandbox) -> None:
        argv = step.args if step.exec_form else [*st.shell, step.raw]
        if st.workdir:
            await sbx.files.make_dir(st.workdir)
        lines: list[str] = []

        def out(text: str) -> None:
            lines[:] = [*lines, *text.splitlines()][-60:]
            if self.on_output is not None:
                self.on_output(text)

        env = st.vars()
        ca = self.opts.host_ca
        if ca and Path(ca).is_file():
            await sbx.files.write(CA_IN_SANDBOX, Path(ca).read_bytes(), mode=0o644)
            env = {**{k: CA_IN_SANDBOX for k in CA_VARS}, **env}
        try:
            r = await sbx.commands.run(
                argv, cwd=st.workdir, env=env or None, user=st.user,
                timeout=self.opts.step_timeout, on_stdout=out, on_stderr=out,
            )  # fmt: skip
        finally:
            if ca and Path(ca).is_file():
                await sbx.files.remove(CA_IN_SANDBOX)
        if r.exit_code != 0:
            audit = await sbx.audit()
            output = "\n".join(lines)
            if self.opts.network and (audit.dns_denied or _NET_TROUBLE.search(output)):
                # The node's resolver (maybe in another process: the leader)
                # writes its refusals once a tick: wait for this step's.
                for _ in range(8):
                    if audit.dns_denied_names:
                        break
                    await asyncio.sleep(0.5)
                    audit = await sbx.audit()
            why = f"line {step.line}: `{step.text[:120]}` exited {r.exit_code}"
            hosts = sorted(set(audit.dns_denied_names) | set(_HOSTS.findall("\n".join(lines))))
            if audit.egress_denied or audit.dns_denied or hosts:
                why += "; the build's network policy refused"
                why += f" {', '.join(hosts)}" if hosts else " a connection"
                why += " (open one with the build's network option)"
            raise InvalidArgument("dockerfile", why, "\n".join(lines)[-3000:])

    async def _copy_from(
        self,
        stages: dict[str, State],
        name: str,
        sources: list[str],
        st: State,
        line: int,
        rename: str | None,
    ) -> tuple[bytes, str, bool]:
        """The sources from another stage's image (or any image) as a tar;
        whether it is one file, named `rename` (COPY's FILE to a path)."""
        single = False
        other = stages.get(name.lower())
        ref = other.digest if other else await self._digest(name)
        sbx = await self.client.sandboxes.create(image=ref, ttl=600)
        try:
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w") as out:
                for src in sources:
                    path = "/" + substitute(src, st.vars()).lstrip("/")
                    entry = await sbx.files.stat(path)
                    if entry.type == "dir":
                        data = await sbx.files.download_tar(path)
                        with tarfile.open(fileobj=io.BytesIO(data)) as got:
                            for m in got.getmembers():
                                f = got.extractfile(m) if m.isreg() else None
                                out.addfile(m, f)
                    else:
                        data = await sbx.files.read(path)
                        single = rename is not None
                        info = tarfile.TarInfo(rename or Path(path).name)
                        info.size, info.mode = len(data), entry.mode & 0o7777
                        out.addfile(info, io.BytesIO(data))
        except CorralError as exc:
            raise InvalidArgument(
                "dockerfile", f"line {line}: COPY --from={name}: {exc.message}", sources
            ) from None
        finally:
            await sbx.close()
        data = buf.getvalue()
        return data, hashlib.sha256(data).hexdigest(), single

    async def _files(self, stages: dict[str, State], step: Instruction,
                     st: State) -> tuple[str, bytes, str]:  # fmt: skip
        """COPY/ADD: where to, the tar, its digest."""
        *sources, raw_dest = [substitute(a, st.vars()) for a in step.args]
        dest = raw_dest
        mode = int(step.flags["chmod"], 8) if "chmod" in step.flags else None
        owner = None
        if "chown" in step.flags:
            uid, _, gid = step.flags["chown"].partition(":")
            if not uid.isdigit() or (gid and not gid.isdigit()):
                raise InvalidArgument("dockerfile", f"line {step.line}: --chown takes numeric "
                                      "uid[:gid]", step.flags["chown"])  # fmt: skip
            owner = (int(uid), int(gid or uid))
        if not dest.startswith("/"):
            dest = posixpath.join(st.workdir or "/", dest)
        if "from" in step.flags:
            to_dir = raw_dest.endswith(("/", "/.")) or raw_dest in (".", "./")
            rename = posixpath.basename(dest) if len(sources) == 1 and not to_dir else None
            data, digest, single = await self._copy_from(
                stages, step.flags["from"], sources, st, step.line, rename
            )
            return (posixpath.dirname(dest) if single else dest), data, digest
        if step.kind == "ADD" and any(re.match(r"^[a-z]+://", s) for s in sources):
            raise InvalidArgument("dockerfile", f"line {step.line}: ADD from a URL is not "
                                  "supported: use RUN curl (the build's network policy then "
                                  "decides what it reaches)", sources)  # fmt: skip
        files = self.ctx.files(sources, step.line)
        # A destination is a directory when it says so (a trailing / or .)
        # or is the working directory; else one file's destination is its name.
        as_dir = raw_dest.endswith(("/", "/.")) or raw_dest in (".", "./") or (
            posixpath.normpath(dest) == posixpath.normpath(st.workdir or "/"))  # fmt: skip
        single = len(files) == 1 and not self.ctx.root.joinpath(sources[0].lstrip("/")).is_dir()
        if single and not as_dir:
            files = [(files[0][0], posixpath.basename(posixpath.normpath(dest)))]
            dest = posixpath.dirname(posixpath.normpath(dest)) or "/"
        if step.kind == "ADD" and len(files) == 1 and tarfile.is_tarfile(files[0][0]):
            raw = files[0][0].read_bytes()
            data = gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw
            return dest, data, hashlib.sha256(data).hexdigest()
        data, digest = self.ctx.tar(files, mode, owner)
        return dest, data, digest

    async def _layer_step(self, stages: dict[str, State], st: State, step: Instruction) -> None:
        t0 = time.monotonic()
        copy: tuple[str, bytes, str] | None = None
        if step.kind in ("COPY", "ADD"):
            copy = await self._files(stages, step, st)
        key = self._key(st, step, copy[0] + copy[2] if copy else "")
        found = await self._cached(key)
        cached = found is not None
        if found is None:
            sbx = await self._sandbox(st, network=step.kind == "RUN")
            try:
                if copy is not None:
                    await sbx.files.upload_tar(copy[0], copy[1])
                else:
                    await self._run(st, step, sbx)
                found = await self._commit(sbx, st, key, step)
            finally:
                await sbx.close()
        st.digest = found.digest
        self.steps.append(
            StepReport(step.line, step.text, cached, time.monotonic() - t0, found.digest)
        )

    def _config_step(self, st: State, step: Instruction) -> None:
        v = st.vars()
        if step.kind == "ENV":
            for k, value in env_pairs(step, v):
                st.env[k] = value
        elif step.kind == "ARG":
            name, sep, default = step.args[0].partition("=")
            st.args[name] = self.opts.build_args.get(name, substitute(default, v) if sep else "")
        elif step.kind == "WORKDIR":
            path = substitute(step.args[0], v)
            st.workdir = path if path.startswith("/") else f"{st.workdir or ''}/{path}"
        elif step.kind == "USER":
            st.user = substitute(step.args[0], v)
        elif step.kind == "SHELL":
            st.shell = list(step.args)
        elif step.kind == "LABEL":
            for k, value in env_pairs(step, v):
                st.labels[f"label.{k}"[:128]] = value
        else:  # CMD, ENTRYPOINT, EXPOSE, ...: recorded, not run
            st.labels[f"build.{step.kind.lower()}"] = json.dumps(step.args)

    # ------------------------------------------------------------ the build

    async def build(self, dockerfile: str) -> BuildResult:
        stages_src: list[Stage] = parse(dockerfile)
        total = sum(len(s.steps) + 1 for s in stages_src)
        done = 0
        stages: dict[str, State] = {}
        st = State(ref="")
        for index, stage in enumerate(stages_src):
            done += 1
            self.on_step(done, total, f"FROM {stage.base}")
            earlier = stages.get(stage.base.lower())
            st = replace(earlier, labels=dict(earlier.labels), env=dict(earlier.env),
                         args={}) if earlier else State(ref=stage.base)  # fmt: skip
            if not earlier:
                st.digest = await self._digest(stage.base)
            for step in stage.steps:
                done += 1
                self.on_step(done, total, step.text)
                if step.kind in ("RUN", "COPY", "ADD"):
                    await self._layer_step(stages, st, step)
                else:
                    self._config_step(st, step)
            stages[stage.name or str(index)] = st
        image = await self._final(st)
        return BuildResult(image, self.steps)

    async def _final(self, st: State) -> LayerInfo:
        """The image: the last stage's layers, its config on top, tagged."""
        sbx = await self._sandbox(st, network=False)
        try:
            if st.workdir:
                await sbx.files.make_dir(st.workdir)
            return await self._commit(sbx, st, "", Instruction("TAG", 0, "", []), self.opts.tag)
        finally:
            await sbx.close()
