"""Dockerfile builds (corral.build): every step in a real sandbox on the
node, layers stacked by commit, cached by content, under the build's
network policy; and the Dockerfiles that must be refused."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

import corral
from corral.build.builder import Builder, BuildResult, Options

from ..framework import Node
from ..framework.images import require_image

DOCKERFILE = """\
FROM debian-python:bookworm AS builder
RUN mkdir -p /out && echo built > /out/artifact.txt

FROM debian-python:bookworm
ARG GREETING=hi
ENV APP_HOME=/srv/app MODE="a b"
WORKDIR $APP_HOME
COPY app/ ./
COPY --from=builder /out/artifact.txt /opt/artifact.txt
RUN echo "$GREETING" > greeting.txt && python3 main.py > run.txt
RUN python3 -c "import urllib.request as u; \\
    print(u.urlopen('http://deb.debian.org/debian/dists/bookworm/Release', timeout=30).status)" \\
    > debian.txt
USER nobody
LABEL team=corral
CMD ["python3", "main.py"]
"""


def context(tmp: Path, dockerfile: str = DOCKERFILE) -> Path:
    (tmp / "app").mkdir(parents=True)
    (tmp / "app" / "main.py").write_text('print("hello from app")\n')
    (tmp / "app" / "secret.txt").write_text("not for the image\n")
    (tmp / "build.log").write_text("noise\n")
    (tmp / ".dockerignore").write_text("# not copied\napp/secret.txt\n*.log\n")
    (tmp / "Dockerfile").write_text(dockerfile)
    return tmp


async def build(c: corral.AsyncClient, ctx: Path, tag: str, **kw: Any) -> BuildResult:
    return await Builder(c, ctx, Options(tag, **kw)).build((ctx / "Dockerfile").read_text())


async def test_a_dockerfile_builds_step_by_step_in_sandboxes(node: Node, tmp_path: Path) -> None:
    require_image("debian-python:bookworm")
    ctx = context(tmp_path)
    async with node.client() as c:
        result = await build(c, ctx, "df-test:1")
        assert [s.line for s in result.steps] == [2, 8, 9, 10, 11]
        sbx = await c.sandboxes.create(image="df-test:1")
        try:
            r = await sbx.commands.run("pwd; id -un; echo $APP_HOME/$MODE; ls; cat greeting.txt "
                                       "run.txt /opt/artifact.txt debian.txt")  # fmt: skip
            assert r.stdout.split("\n") == [
                "/srv/app", "nobody", "/srv/app/a b", "debian.txt", "greeting.txt", "main.py",
                "run.txt", "hi", "hello from app", "built", "200", "",
            ], r  # fmt: skip
        finally:
            await sbx.close()
        (layer,) = [x for x in await c.service.list_layers() if "df-test:1" in x.names]
        assert layer.labels["label.team"] == "corral"
        assert layer.labels["build.cmd"] == '["python3", "main.py"]'


async def test_a_rebuild_runs_only_what_follows_a_change(node: Node, tmp_path: Path) -> None:
    require_image("debian-python:bookworm")
    # This run's own content: the node's build cache outlives test runs.
    ctx = context(tmp_path, DOCKERFILE.replace("hello from app", "x"))
    (ctx / "app" / "seed.txt").write_text(os.urandom(8).hex())
    async with node.client() as c:
        first = await build(c, ctx, "df-cache:1")
        again = await build(c, ctx, "df-cache:1")
        assert all(s.cached for s in again.steps), again.steps
        assert [s.digest for s in again.steps] == [s.digest for s in first.steps]
        (ctx / "app" / "main.py").write_text(f'print("changed {os.urandom(4).hex()}")\n')
        changed = await build(c, ctx, "df-cache:2")
        assert [(s.line, s.cached) for s in changed.steps] == [
            (2, True), (8, False), (9, False), (10, False), (11, False)]  # fmt: skip
        fresh = await build(c, ctx, "df-cache:3", no_cache=True)
        assert not any(s.cached for s in fresh.steps)


BAD: list[tuple[str, str]] = [
    ("FROM debian-python:bookworm\nFETCH x\n", "line 2, column 1: unknown instruction FETCH"),
    ('FROM debian-python:bookworm\nCMD ["a", b]\n', "line 2, column"),
    ('FROM debian-python:bookworm\nRUN echo "unclosed\n', "quotes must close"),
    ("FROM debian-python:bookworm\nONBUILD RUN x\n", "ONBUILD is not supported"),
    ("RUN echo 1\n", "line 1, column 1: RUN before the first FROM"),
    ("# nothing\n", "must have a FROM"),
    ("FROM a AS x\nFROM b AS x\n", "a stage named 'x' exists already"),
    ("FROM debian-python:bookworm\nCOPY --mode=7 a b\n", "COPY does not take the option"),
    ("FROM debian-python:bookworm\nCOPY ../outside /x\n", "COPY source must be inside the context"),
    ("FROM debian-python:bookworm\nCOPY missing.txt /x\n", "COPY source is not in the context"),
    ("FROM debian-python:bookworm\nADD http://example.com/x /x\n", "ADD from a URL"),
    ("FROM no-such-image:1\nRUN true\n", "FROM names an image this node does not have"),
    ("FROM debian-python:bookworm\nRUN echo out; echo err >&2; exit 3\n",
     "line 2: `RUN echo out; echo err >&2; exit 3` exited 3"),
    ("FROM debian-python:bookworm\nRUN python3 -c \"import socket; "
     "socket.getaddrinfo('example.com', 80)\"\n", "refused example.com"),
]  # fmt: skip


@pytest.mark.parametrize(("dockerfile", "says"), BAD)
async def test_a_bad_dockerfile_is_refused_by_line(
    node: Node, tmp_path: Path, dockerfile: str, says: str
) -> None:
    require_image("debian-python:bookworm")
    ctx = context(tmp_path / "ctx", dockerfile)
    async with node.client() as c:
        before = {n for x in await c.service.list_layers() for n in x.names}
        with pytest.raises(corral.InvalidArgument) as err:
            await build(c, ctx, "df-bad:1")
        assert err.value.details["field"] == "dockerfile"
        assert says in err.value.message, err.value.message
        if "exited 3" in says:
            assert "out" in err.value.details["value"] and "err" in err.value.details["value"]
        after = {n for x in await c.service.list_layers() for n in x.names}
        assert "df-bad:1" not in after and not (after - before - {"df-bad:1"}) - {
            n for n in after if n.startswith("build-cache/")}  # fmt: skip
        assert await c.sandboxes.list({"build": "df-bad_1"}) == []  # no build sandbox left


async def test_pypi_in_a_build_step_and_add_of_a_tar(node: Node, tmp_path: Path) -> None:
    """The build reaches PyPI (its network policy; the host's CAs trusted for
    the step, and left out of the layer); ADD unpacks a local tar."""
    import io
    import tarfile

    require_image("debian-python:bookworm")
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo("pkg/data.txt")
        info.size = 5
        tar.addfile(info, io.BytesIO(b"inner"))
    (ctx / "bundle.tar.gz").write_bytes(buf.getvalue())
    (ctx / "Dockerfile").write_text(
        "FROM debian-python:bookworm\n"
        "ADD bundle.tar.gz /opt/\n"
        'RUN python3 -c "import urllib.request as u; print(u.urlopen('
        "'https://pypi.org/simple/six/', timeout=30).status)\" > /pypi.txt\n"
    )
    async with node.client() as c:
        await build(c, ctx, "df-pypi:1", no_cache=True)
        sbx = await c.sandboxes.create(image="df-pypi:1")
        try:
            assert await sbx.files.read("/pypi.txt") == b"200\n"
            assert await sbx.files.read("/opt/pkg/data.txt") == b"inner"
            assert not await sbx.files.exists("/tmp/.corral-build-ca.pem")
        finally:
            await sbx.close()
