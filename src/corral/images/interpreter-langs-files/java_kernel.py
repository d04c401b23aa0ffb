"""Corral's Java kernel for Jupyter: JShell (the JDK's own REPL engine, the
one IJava is built on) in a JVM this kernel starts, driven over a pipe
(CorralJShell.java has the protocol). Runs inside the sandbox, on the
template's ipykernel; kernel name "java", as E2B's template names IJava's.

What a cell does, as in IJava: its snippets run in order; what they print
streams as printed (each write a stream message); the value of the last
one, if it is an expression, is the result; the first exception or
compile error ends the cell as an error. Environment variables are system
properties (the kernel's environment is copied into them at start, E2B's
server sets and restores per-execution ones with System.setProperty).

Invariants: one JVM per kernel, killed with it (PR_SET_PDEATHSIG); an
interrupt reaches the JVM as SIGINT, which stops the running snippet and
the rest of its cell, and never tears a frame (the read is retried, not
abandoned); a JVM that dies (System.exit in a cell) is reported as the
cell's error and started again, empty.
"""

from __future__ import annotations

import codecs
import ctypes
import os
import signal
import struct
import subprocess
from pathlib import Path
from typing import Any

from ipykernel.kernelapp import IPKernelApp
from ipykernel.kernelbase import Kernel

HERE = Path(__file__).resolve().parent
PR_SET_PDEATHSIG = 1
JAVA = ["java", "-XX:+UseSerialGC", "-Djava.awt.headless=true", "-cp", str(HERE), "CorralJShell"]
# Resolved here, not in the child: a fork of a threaded process may not
# dlopen before exec.
_prctl = ctypes.CDLL(None, use_errno=True).prctl


def _child_setup() -> None:
    """In the JVM before exec: it dies with this kernel, and takes SIGINT
    (the kernel app ignores it outside a request, and an ignored signal
    stays ignored across exec: the JVM would never see an interrupt)."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class JavaProcess:
    """The JVM and its two pipes: cells in on stdin, frames out on a pipe
    of their own (the JVM's stdout and stderr stay the kernel's log)."""

    def __init__(self) -> None:
        r, w = os.pipe()
        try:
            # A session of its own: Jupyter interrupts the kernel's process
            # group, and the JVM must get SIGINT only from this kernel, only
            # while a cell runs (do_execute forwards it).
            self.proc = subprocess.Popen(
                [*JAVA, f"/proc/self/fd/{w}"],
                stdin=subprocess.PIPE,
                pass_fds=(w,),
                preexec_fn=_child_setup,
                start_new_session=True,
            )
        finally:
            os.close(w)
        self.frames = os.fdopen(r, "rb")
        kind, _ = self.read()
        if kind != "d":
            raise RuntimeError(f"the JVM did not start (exit {self.proc.wait()})")

    def send(self, code: str) -> None:
        """Raises OSError when the JVM is gone."""
        body = code.encode(errors="replace")
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"x" + struct.pack(">i", len(body)) + body)
        self.proc.stdin.flush()

    def read(self) -> tuple[str, bytes]:
        """The next frame, or ("", b"") when the JVM is gone."""
        head = self.frames.read(5)
        if len(head) < 5:
            return "", b""
        (size,) = struct.unpack(">i", head[1:])
        body = self.frames.read(size)
        if len(body) < size:
            return "", b""
        return chr(head[0]), body

    def interrupt(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGINT)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.frames.close()


class JavaKernel(Kernel):
    implementation = "corral-java"
    implementation_version = "1.0"
    language = "java"
    language_version = "17"
    language_info = {
        "name": "java",
        "version": "17",
        "mimetype": "text/x-java-source",
        "file_extension": ".jshell",
        "codemirror_mode": "java",
    }
    banner = "Java (JShell)"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.java = JavaProcess()

    def do_execute(
        self,
        code: str,
        silent: bool,
        store_history: bool = True,
        user_expressions: dict[str, Any] | None = None,
        allow_stdin: bool = False,
        *,
        cell_id: str | None = None,
    ) -> dict[str, Any]:
        decoders: dict[str, codecs.IncrementalDecoder] = {
            c: codecs.getincrementaldecoder("utf-8")("replace") for c in "oe"
        }
        error: tuple[str, str, list[str]] | None = None
        previous = signal.signal(signal.SIGINT, lambda *_: self.java.interrupt())
        try:
            error = self._run(code, silent, decoders)
        except Exception as exc:  # the cell must get a reply, whatever broke
            # Frames may be half read: the JVM is not trusted again.
            try:
                self._restart()
                again = "a new JVM was started, with none of the earlier cells' state"
            except Exception as start:
                again = f"no new JVM could be started ({start}); the next cell tries again"
            error = (type(exc).__name__, f"the Java kernel failed: {exc}; {again}", [])
        finally:
            signal.signal(signal.SIGINT, previous)
        if error is None:
            return {"status": "ok", "execution_count": self.execution_count,
                    "payload": [], "user_expressions": {}}  # fmt: skip
        name, value, lines = error
        content: dict[str, Any] = {
            "ename": name,
            "evalue": value,
            "traceback": lines or [f"{name}: {value}"],
        }
        if not silent:
            self.send_response(self.iopub_socket, "error", content)
        return {"status": "error", "execution_count": self.execution_count, **content}

    def _restart(self) -> None:
        try:
            self.java.close()
        finally:
            self.java = JavaProcess()

    def _run(
        self, code: str, silent: bool, decoders: dict[str, codecs.IncrementalDecoder]
    ) -> tuple[str, str, list[str]] | None:
        """Sends a cell and relays its frames; its error, if any."""
        error = None
        try:
            self.java.send(code)
        except (OSError, ValueError):
            # Gone between cells (a thread's System.exit, the OOM killer),
            # or closed when a restart failed.
            kind = ""
        else:
            kind = "?"
        while kind:
            kind, body = self.java.read()
            if kind == "d":
                break
            if kind in ("o", "e"):
                self._stream(kind, decoders[kind].decode(body), silent)
            elif kind == "r" and not silent:
                self.send_response(self.iopub_socket, "execute_result", {
                    "execution_count": self.execution_count,
                    "data": {"text/plain": body.decode(errors="replace")},
                    "metadata": {},
                })  # fmt: skip
            elif kind == "E":
                name, value, text = body.decode(errors="replace").split("\0", 2)
                error = (name, value, text.splitlines())
        for k, d in decoders.items():
            self._stream(k, d.decode(b"", final=True), silent)
        if kind == "":
            try:
                status: int | None = self.java.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                status = None  # its pipe closed, it lingers: the restart kills it
            self._restart()
            return ("JVMExited", f"the JVM exited (status {status}); a new one was "
                    "started, with none of the earlier cells' state", [])  # fmt: skip
        return error

    def _stream(self, kind: str, text: str, silent: bool) -> None:
        if text and not silent:
            stream = {"name": "stdout" if kind == "o" else "stderr", "text": text}
            self.send_response(self.iopub_socket, "stream", stream)

    def do_shutdown(self, restart: bool) -> dict[str, Any]:
        self.java.close()
        return {"status": "ok", "restart": restart}


if __name__ == "__main__":
    IPKernelApp.launch_instance(kernel_class=JavaKernel)
