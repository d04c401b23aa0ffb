"""Files: read/write/list/stat/remove/mkdir, tar in and out, and the paths
and sizes that are refused."""

from __future__ import annotations

import io
import mmap
import tarfile

import pytest

import corral

from ..framework import IMAGE


@pytest.fixture
async def sbx(client: corral.AsyncClient) -> corral.AsyncSandbox:
    return await client.sandboxes.create(image=IMAGE, memory="256MiB")


async def test_write_read_list_stat_remove(sbx: corral.AsyncSandbox) -> None:
    n = await sbx.files.write("/workspace/pkg/a.py", b"print('a')\n", mode=0o755)
    assert n == 11
    assert await sbx.files.read("/workspace/pkg/a.py") == b"print('a')\n"
    assert (await sbx.commands.run("python3 /workspace/pkg/a.py")).stdout == "a\n"
    await sbx.files.write("/workspace/pkg/b.bin", bytes(range(256)) * 4096)
    entries = await sbx.files.list("/workspace/pkg")
    assert [(e.name, e.type) for e in entries] == [("a.py", "file"), ("b.bin", "file")]
    assert entries[0].mode == 0o755 and entries[1].size == 256 * 4096
    st = await sbx.files.stat("/workspace/pkg")
    assert st.type == "dir" and st.path == "/workspace/pkg"
    await sbx.files.remove("/workspace/pkg/a.py")
    assert not await sbx.files.exists("/workspace/pkg/a.py")
    await sbx.files.remove("/workspace")
    assert not await sbx.files.exists("/workspace")
    await sbx.files.make_dir("/a/b/c")
    assert (await sbx.files.stat("/a/b/c")).type == "dir"


async def test_files_respect_the_user(sbx: corral.AsyncSandbox) -> None:
    await sbx.files.write("/root/secret", "x")
    await sbx.commands.run("chmod 700 /root")
    with pytest.raises(corral.FileError) as exc:
        await sbx.files.read("/root/secret", user="nobody")
    assert exc.value.details["strerror"] == "EACCES"
    await sbx.files.write("/tmp/mine", "y", user="nobody")
    assert (await sbx.commands.run("stat -c %u /tmp/mine")).stdout == "65534\n"


async def test_missing_files_and_wrong_types(sbx: corral.AsyncSandbox) -> None:
    with pytest.raises(corral.FileNotFound) as exc:
        await sbx.files.read("/no/such/file")
    assert isinstance(exc.value, FileNotFoundError)
    with pytest.raises(corral.FileError) as exc2:
        await sbx.files.read("/etc")
    assert exc2.value.details["strerror"] == "EISDIR"
    with pytest.raises(corral.FileError):
        await sbx.files.read("/dev/zero")  # not a regular file: never streams forever
    with pytest.raises(corral.FileNotFound):
        await sbx.files.list("/nope")


@pytest.mark.parametrize(
    "path", ["../../etc/passwd", "etc/passwd", "/a/../../etc/passwd", "/x\x00y", ""]
)
async def test_paths_outside_the_sandbox_are_refused(sbx: corral.AsyncSandbox, path: str) -> None:
    for op in (
        sbx.files.read(path),
        sbx.files.write(path, b"x"),
        sbx.files.list(path),
        sbx.files.remove(path),
    ):
        with pytest.raises(corral.InvalidArgument) as exc:
            await op
        assert exc.value.field == "path"


async def test_removing_the_root_is_refused(sbx: corral.AsyncSandbox) -> None:
    with pytest.raises(corral.InvalidArgument):
        await sbx.files.remove("/")


async def test_a_10_gib_write_is_refused_before_anything_moves(
    embedded: corral.AsyncClient,
) -> None:
    sbx = await embedded.sandboxes.create(image=IMAGE)
    # A 10 GiB buffer that costs no memory: untouched anonymous pages.
    huge = mmap.mmap(-1, 10 * 2**30, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = memoryview(huge)
    try:
        with pytest.raises(corral.InvalidArgument) as exc:
            await sbx.files.write("/tmp/huge", view)
        assert exc.value.field == "data" and "10737418240 bytes" in str(exc.value)
    finally:
        view.release()  # the traceback's frames still name it
        huge.close()
    assert not await sbx.files.exists("/tmp/huge")


async def test_tar_upload_and_download(sbx: corral.AsyncSandbox) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in {"proj/main.py": b"print(1)\n", "proj/data/x.txt": b"x" * 10000}.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    await sbx.files.upload_tar("/workspace", buf.getvalue())
    assert (await sbx.commands.run("python3 main.py", cwd="/workspace/proj")).stdout == "1\n"
    out = await sbx.files.download_tar("/workspace/proj")
    with tarfile.open(fileobj=io.BytesIO(out)) as tar:
        names = sorted(m.name.lstrip("./") for m in tar.getmembers() if m.isfile())
        assert names == ["data/x.txt", "main.py"]
    with pytest.raises(corral.FileError):
        await sbx.files.upload_tar("/workspace", b"this is not a tar archive" * 100)
