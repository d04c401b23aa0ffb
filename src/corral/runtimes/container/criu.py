"""A container to disk and back with CRIU: suspend(mode="disk").

The sandbox's processes are checkpointed (`criu dump`, which ends them)
into <sandbox>/checkpoint and restored (`criu restore`) in a private mount
namespace where corral-nsexec mounts the sandbox's overlay again, as at
create. Same node, same id, same user namespace block and cgroups: the
sandbox holds only disk in between.

What CRIU cannot take across, and how each is handled:
- corral-init's listener (fd 3) is a socket of the host's network namespace,
  which CRIU cannot dump: init parks it first (REQ_PARK, native/proto.h),
  putting a memfd named corral-ctl-<nonce> in its place; restore hands a
  new listener, bound at the same control path, in place of that memfd
  (--inherit-fd), and the node then unparks init (which execs itself, so
  its memory belongs to the sandbox's user namespace again and the next
  checkpoint works).
- bind mounts from the host (the platform layer, /dev/null over masked
  /proc files, device nodes) are declared external and bound again at
  restore (a masked directory binds the platform layer's empty one, and
  /sys/fs/cgroup its cgroup skeleton, which CRIU carries as binds of
  /.corral; the sandbox's cgroups bound on the skeleton are cgroup mounts,
  which CRIU makes itself); init's stdout/stderr (oci.out,
  outside the sandbox's mounts) is an external file, given back as the
  restoring criu's fd 1.
- a command's connection to the agent, a network interface, and the
  seccomp listener held by seccompd are not carried: a sandbox running a
  command or with a network is refused (node/snapshots.py), and after a
  restore the syscalls the guard would have asked seccompd about fail
  with ENOSYS (closed, uncounted) instead (docs/preemption.md).

If the dump fails, CRIU lets the processes run on; the node unparks init
with a new listener and the sandbox stays running, untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from corral.errors import SandboxFailed
from corral.guard import profile
from corral.host import spawn
from corral.log import get_logger

log = get_logger("corral.criu")

CRIU = "/usr/local/sbin/criu"
CLONE_NEWNET = 0x40000000
# A dump or restore writes or reads the memory at disk speed (~1 s per GiB
# here), a pack or unpack the writable layer too: ten minutes is far past
# any healthy one.
HELPER_TIMEOUT = 600.0
_libc = ctypes.CDLL(None, use_errno=True)
# Kernel file systems a sandbox mounts itself (CRIU recreates them).
_OWN_FS = {"proc", "sysfs", "tmpfs", "devpts", "mqueue", "cgroup", "cgroup2", "overlay"}


def available() -> str | None:
    """Why disk suspends cannot work here, or None when they can."""
    if not os.access(CRIU, os.X_OK):
        return f"{CRIU} is missing (scripts/build-criu.sh builds it)"
    return None


@dataclass(frozen=True)
class Layout:
    """What restore needs of the sandbox as it was created (recorded at
    start: the runtime has no Prepared at resume)."""

    lower: list[str]
    upper: str
    work: str
    rootfs: str
    control: str
    platform_dir: str
    host_id: int | None

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.__dict__))

    @classmethod
    def load(cls, path: Path) -> Layout:
        return cls(**json.loads(path.read_text()))


def _mountinfo(pid: int) -> list[tuple[int, str, str, str]]:
    """(mount id, root, mount point, fs type) of each mount `pid` sees."""
    out = []
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        left, right = line.split(" - ", 1)
        f = left.split()
        out.append((int(f[0]), f[3], f[4], right.split()[0]))
    return out


def _externals(pid: int, platform_dir: str) -> tuple[list[str], dict[str, str], list[str]]:
    """criu dump's --external options, the mounts restore binds again
    (cookie -> host source), and the external files (init's stdout)."""
    opts: list[str] = []
    binds: dict[str, str] = {}
    mounts = _mountinfo(pid)
    for _id, root, mp, fstype in mounts:
        if mp == "/" or fstype in _OWN_FS:
            continue
        if mp in profile.MASKED_PATHS or mp == "/sys/fs/cgroup":
            # A masked directory binds the platform layer's empty one
            # (bundle.masks), /sys/fs/cgroup its cgroup skeleton
            # (bundle.cgroup_mounts): CRIU restores each as a bind of /.corral.
            continue
        if mp == "/.corral":
            cookie, src = "platform", platform_dir
        elif fstype == "devtmpfs" and root == "/null":
            cookie, src = "devnull", "/dev/null"
        elif fstype == "devtmpfs":
            cookie, src = f"dev{root.replace('/', '-')}", f"/dev{root}"
        else:
            raise SandboxFailed(f"a mount CRIU cannot carry: {mp} ({fstype})")
        binds[cookie] = src
        opts += ["--external", f"mnt[{mp}]:{cookie}"]
    ids = {m[0] for m in mounts}
    files: list[str] = []
    for fd in ("1", "2"):
        link = os.readlink(f"/proc/{pid}/fd/{fd}")
        info = dict(
            line.split(":\t", 1)
            for line in Path(f"/proc/{pid}/fdinfo/{fd}").read_text().splitlines()
            if ":\t" in line
        )
        mnt = int(info.get("mnt_id", "-1"))
        if link.startswith("/") and mnt not in ids:
            key = f"file[{mnt:x}:{os.stat(f'/proc/{pid}/fd/{fd}').st_ino:x}]"
            if key not in files:
                files.append(key)
                opts += ["--external", key]
    return opts, binds, files


def _sockets(pid: int) -> dict[int, list[str]]:
    """Each process of the tree of `pid` with the sockets it holds (what a
    failed dump most often trips on)."""
    out: dict[int, list[str]] = {}
    todo = [pid]
    while todo:
        p = todo.pop()
        with contextlib.suppress(OSError):
            fds = os.listdir(f"/proc/{p}/fd")
            out[p] = [
                f"{fd}:{os.readlink(f'/proc/{p}/fd/{fd}')}"
                for fd in fds
                if os.readlink(f"/proc/{p}/fd/{fd}").startswith("socket:")
            ]
            todo += [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
    return out


def handlers(pid: int) -> list[int]:
    """The children of init `pid` that are its request handlers (each holds
    a connection to the agent while it lives, which CRIU cannot dump)."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    out = []
    for c in children:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{c}/exe").endswith("/.corral/bin/corral-init"):
                out.append(int(c))
    return out


def unpark(pid: int, nonce: str, listener: socket.socket | None) -> None:
    """Hand a parked init (pid, on the host) a listener, or none to keep
    the one restore put in place (proto.h REQ_PARK). The abstract socket
    is in the sandbox's network namespace: this thread enters it to make
    its socket, then returns to its own."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    theirs = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
    try:
        if _libc.setns(theirs, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns into the sandbox's network namespace")
        try:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        finally:
            if _libc.setns(own, CLONE_NEWNET) != 0:  # never stay in the sandbox's
                raise OSError(ctypes.get_errno(), "setns back to the host's network namespace")
    finally:
        os.close(own)
        os.close(theirs)
    with s:
        s.settimeout(10)
        s.connect(f"\0corral-park-{nonce}")
        fds = [listener.fileno()] if listener is not None else []
        socket.send_fds(s, [b"u"], fds)
        # init closes its end when it execs: wait for that, so the caller
        # never talks to the old image.
        with contextlib.suppress(OSError):
            s.recv(1)


async def _run(argv: list[str], *, pass_fds: tuple[int, ...] = ()) -> tuple[int, str]:
    """CRIU (or tar) to its end: a nonzero code and its stderr fail the
    caller's step, as does one killed past HELPER_TIMEOUT (a task stuck
    in the kernel under a dump), which would otherwise hold the
    sandbox's change, and its close, for ever."""
    try:
        done = await spawn.run(
            argv, pass_fds=pass_fds, env={**os.environ, "CORRAL_AGENT_PID": str(os.getpid())},
            timeout=HELPER_TIMEOUT,
        )  # fmt: skip
    except TimeoutError:
        return -9, f"{Path(argv[0]).name} ran past {HELPER_TIMEOUT:g} s and was killed"
    return done.code, done.stderr.decode(errors="replace")


def _errors(log_file: Path, stderr: str) -> str:
    """Why CRIU failed: its log's last errors, else what it (or the node,
    for one killed past its bound, which left no log) said on stderr."""
    try:
        lines = log_file.read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    errs = [ln for ln in lines if "Error" in ln]
    return "; ".join(errs[-3:]) or stderr.strip() or (lines[-1] if lines else "(no log)")


def _readable(holder: Path) -> Path:
    """The images dir inside `holder`. criu restore reads the images from
    inside the sandbox's user namespace, where its tasks may, for a moment,
    have no mapped uid at all (seen: EACCES opening timens-0.img under
    load): the images are world-readable (0644 in a 0711 dir) in a holder
    only root can enter (0700). CRIU opens the images dir once, as root,
    and its tasks read through that fd, never through the holder."""
    holder.chmod(0o700)
    images = holder / "img"
    images.chmod(0o711)
    for p in images.iterdir():
        p.chmod(0o644)
    return images


def listen(control: Path) -> socket.socket:
    """A new listener at the sandbox's control path (0600)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    control.unlink(missing_ok=True)
    listener.bind(str(control))
    os.chmod(control, 0o600)
    listener.listen(512)
    return listener


async def dump(
    pid: int,
    images: Path,
    layout: Layout,
    nonce: str,
    freezer: Path | None,
    leave_running: bool = False,
    hybrid: bool = False,
) -> int:
    """Checkpoint the process tree of init `pid` (parked with `nonce`,
    its cgroup frozen) into `images`, ending it. Returns the image bytes.
    On a failure CRIU leaves the tree as it found it: the caller thaws and
    unparks it. `hybrid`: a host of v1 controllers beside a cgroup2 mount,
    which CRIU is kept off (v1_controllers)."""
    holder = images
    if holder.exists():
        shutil.rmtree(holder)
    holder.mkdir(mode=0o700)
    images = holder / "img"
    images.mkdir(mode=0o700)
    opts, binds, files = _externals(pid, layout.platform_dir)
    # No network lock: a sandbox's outside link is unplugged before the dump
    # (network.py) and its loopback peers are dumped with it, so nothing can
    # see a connection change state; the lock's nftables table cost ~20 ms
    # each way (made at dump, removed at restore).
    argv = [CRIU, "dump", "-t", str(pid), "-D", str(images), "-o", "dump.log",
            "--manage-cgroups", "--network-lock", "skip", "--file-locks",
            "--tcp-established", *opts]  # fmt: skip
    if freezer is not None:
        argv += ["--freeze-cgroup", str(freezer)]
    if hybrid:
        for name in v1_controllers(pid):
            argv += ["--cgroup-dump-controller", name]
    if leave_running:  # a snapshot: the source runs on
        argv.append("--leave-running")
    code, err = await _run(argv)
    if code != 0:
        why = _errors(images / "dump.log", err)
        with contextlib.suppress(OSError):  # kept for whoever asks why
            shutil.copy(images / "dump.log", holder.parent / "dump-failed.log")
        shutil.rmtree(holder, ignore_errors=True)
        raise SandboxFailed(
            f"checkpointing failed (the sandbox runs on): {why}; sockets: {_sockets(pid)}"
        )
    meta = {"nonce": nonce, "binds": binds, "files": files}
    (images / "corral.json").write_text(json.dumps(meta))
    _readable(holder)
    return sum(p.stat().st_size for p in images.iterdir() if p.is_file())


def v1_controllers(pid: int) -> list[str]:
    """The v1 hierarchies `pid` is in, as /proc names them ("cpu,cpuacct",
    "name=systemd"). On a hybrid host CRIU takes these only, not the
    cgroup2 mount, where a sandbox holds no controller and no cgroup of its
    own (crun's, hidden, is a tmpfs: corral-nsexec --unified): its tasks
    are in the node agent's cgroup2 there, and CRIU walked the whole mount
    from it at every dump (any cgroup removed meanwhile by a close failed
    the dump), then restored each copy into a cgroup2 directory named
    after its source's, one level deeper per generation."""
    names = []
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, name, _ = line.split(":", 2)
        if name:
            names.append(name)
    return names


async def restore(
    holder: Path, layout: Layout, nsexec: Path, hybrid: bool, cgroup_root: str | None = None
) -> int:
    """Restore the checkpoint in `holder`; returns init's new host pid."""
    images = holder / "img"
    meta = json.loads((images / "corral.json").read_text())
    # The overlay was volatile; its last user ended cleanly (CRIU killed it),
    # but the marker stays and would refuse the new mount.
    shutil.rmtree(Path(layout.work) / "work" / "incompat", ignore_errors=True)
    rootfs = Path(layout.rootfs)
    bundle = rootfs.parent  # the container's (OciRuntime.bundle)
    out = bundle / "oci.out"
    out.touch(mode=0o600)
    if layout.host_id is not None:
        # Opened again by the restored init as its own root, not the host's.
        os.chown(out, layout.host_id, layout.host_id)
    pidfile = images / "restored.pid"
    pidfile.unlink(missing_ok=True)
    (images / "restore.log").unlink(missing_ok=True)
    _readable(holder)
    overlay = [":".join(layout.lower), layout.upper, layout.work, str(rootfs)]
    argv = [str(nsexec), *(["--hybrid"] if hybrid else []), "--overlay", *overlay]
    if layout.host_id is not None:
        argv += ["--idmap", f"{layout.host_id}:65536", "--stage", str(bundle / "stage")]
    listener = listen(Path(layout.control))
    try:
        argv += ["--listen-fd", str(listener.fileno()), "--log", str(out), "--",
                 CRIU, "restore", "-D", str(images), "-o", "restore.log", "--root", str(rootfs),
                 "--restore-detached", "--pidfile", str(pidfile),
                 "--manage-cgroups", "--file-locks", "--tcp-established"]  # fmt: skip
        if cgroup_root is not None:  # another sandbox's cgroups (made by the node)
            argv += ["--cgroup-root", cgroup_root]
        for cookie, src in meta["binds"].items():
            argv += ["--external", f"mnt[{cookie}]:{src}"]
        for key in meta["files"]:
            argv += ["--inherit-fd", f"fd[1]:{key}"]  # nsexec made oci.out our fd 1
        argv += ["--inherit-fd", f"fd[3]:/memfd:corral-ctl-{meta['nonce']}"]
        t0 = time.monotonic()
        code, err = await _run(argv, pass_fds=(listener.fileno(),))
        if code != 0:
            with contextlib.suppress(OSError):
                shutil.copy(images / "restore.log", bundle / "restore-failed.log")
            raise SandboxFailed(
                f"restoring its checkpoint failed: {_errors(images / 'restore.log', err)}"
            )
        pid = int(pidfile.read_text().strip())
        await asyncio.to_thread(unpark, pid, meta["nonce"], None)
    finally:
        listener.close()
    log.info("criu.restored", pid=pid, ms=round((time.monotonic() - t0) * 1000, 1))
    return pid


# ------------------------------------------------------------ checkpoints that move
# A checkpoint restored as another sandbox (a fork's copy, a restore on
# another node) gets that sandbox's own user-namespace id block: CRIU
# restores the uid/gid maps it dumped, so they are rewritten, and the
# writable layer's owners are shifted by the same amount.


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = buf[i]
        value |= (b & 0x7F) << shift
        i += 1
        if not b & 0x80:
            return value, i
        shift += 7


def _put_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        b = value & 0x7F
        value >>= 7
        out.append(b | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _fields(msg: bytes) -> list[tuple[int, int, int | bytes]]:
    """(field, wire type, value) of a protobuf message (varint and
    length-delimited fields: all an id map has)."""
    out: list[tuple[int, int, int | bytes]] = []
    i = 0
    while i < len(msg):
        key, i = _varint(msg, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            v, i = _varint(msg, i)
            out.append((field, wire, v))
        elif wire == 2:
            n, i = _varint(msg, i)
            out.append((field, wire, msg[i : i + n]))
            i += n
        else:
            raise SandboxFailed(f"checkpoint: an id map field of wire type {wire}")
    return out


def _encode(fields: list[tuple[int, int, int | bytes]]) -> bytes:
    out = bytearray()
    for field, wire, v in fields:
        out += _put_varint(field << 3 | wire)
        if isinstance(v, int):
            out += _put_varint(v)
        else:
            out += _put_varint(len(v)) + v
    return bytes(out)


def remap_userns(images: Path, old: int, new: int) -> None:
    """Rewrite the user namespace's uid and gid maps (UsernsEntry: repeated
    extents of first, lower_first, count) from host block `old` to `new`.
    An image is 8 bytes of magic, then entries of u32 size + message."""
    for img in images.glob("userns-*.img"):
        raw = img.read_bytes()
        out, i = bytearray(raw[:8]), 8
        while i < len(raw):
            size = int.from_bytes(raw[i : i + 4], "little")
            entry = raw[i + 4 : i + 4 + size]
            i += 4 + size
            maps = []
            for field, wire, v in _fields(entry):
                if wire == 2 and isinstance(v, bytes):
                    ext = [(f, w, (x - old + new) if f == 2 and isinstance(x, int) else x)
                           for f, w, x in _fields(v)]  # fmt: skip
                    if not any(f == 2 and x == new for f, _w, x in ext):
                        raise SandboxFailed("checkpoint: its id map is not the sandbox's block")
                    v = _encode(ext)
                maps.append((field, wire, v))
            body = _encode(maps)
            out += len(body).to_bytes(4, "little") + body
        img.write_bytes(bytes(out))


def shift_owners(root: Path, old: int, new: int) -> None:
    """Give every file under `root` (a writable layer) the same owner in
    the new id block as it had in the old one."""
    delta = new - old
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            os.lchown(p, st.st_uid + delta, st.st_gid + delta)
    st = os.lstat(root)
    os.lchown(root, st.st_uid + delta, st.st_gid + delta)


async def pack(holder: Path, upper: Path, state: Path, host_id: int | None) -> int:
    """One file of a checkpoint and its writable layer (a tar keeping
    owners, modes, xattrs and the overlay's whiteouts). Returns bytes."""
    st = os.lstat(upper)
    meta = {"host_id": host_id, "upper": [st.st_uid, st.st_gid, st.st_mode & 0o7777]}
    (holder / "img" / "moved.json").write_text(json.dumps(meta))
    code, err = await _run(["tar", "--create", "--file", str(state), "--numeric-owner",
                            "--xattrs", "--xattrs-include=*", "--acls", "--sparse",
                            "-C", str(holder), "img", "-C", str(upper.parent),
                            f"--transform=s,^{upper.name},upper,", upper.name])  # fmt: skip
    if code != 0:
        raise SandboxFailed(f"packing the checkpoint failed: {err.strip()}")
    return state.stat().st_size


async def unpack(state: Path, holder: Path, upper: Path, host_id: int | None) -> None:
    """A packed checkpoint made this sandbox's: images in `holder`, the
    writable layer in `upper`, both moved to this sandbox's id block."""
    holder.mkdir(mode=0o700, exist_ok=True)
    common = ["tar", "--extract", "--file", str(state), "--numeric-owner", "--same-permissions",
              "--xattrs", "--xattrs-include=*", "--acls"]  # fmt: skip
    # Straight into place: the writable layer is on the scratch pool, the
    # images beside the sandbox (a rename cannot cross).
    for argv in ([*common, "-C", str(holder), "img"],
                 [*common, "-C", str(upper), "--strip-components=1", "upper"]):  # fmt: skip
        code, err = await _run(argv)
        if code != 0:
            raise SandboxFailed(f"unpacking the checkpoint failed: {err.strip()}")
    moved = json.loads((holder / "img" / "moved.json").read_text())
    uid, gid, mode = moved["upper"]
    os.chown(upper, uid, gid)
    os.chmod(upper, mode)
    old = moved["host_id"]
    if (old is None) != (host_id is None):
        raise SandboxFailed("checkpoint: saved with and restored without a user namespace")
    if old is not None and host_id is not None and old != host_id:
        await asyncio.to_thread(remap_userns, holder / "img", old, host_id)
        await asyncio.to_thread(shift_owners, upper, old, host_id)
