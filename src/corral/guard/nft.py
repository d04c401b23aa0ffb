"""nftables through libnftables (no `nft` process per change)."""

from __future__ import annotations

import ctypes
import json
import threading
from typing import Any

from corral.errors import Unavailable

# One call into libnftables at a time in this process, whatever the
# context: libnftables does not document its contexts as safe to use from
# several threads at once, and a process may hold several (every embedded
# node has one). Two CI sessions aborted inside nft_run_cmd_from_buffer
# while closing a node's table; the cause is not established, and this
# rules one out.
_LOCK = threading.Lock()


class Nft:
    def __init__(self) -> None:
        try:
            self._lib = ctypes.CDLL("libnftables.so.1")
        except OSError as exc:
            raise Unavailable("libnftables is missing: apt-get install nftables") from exc
        lib = self._lib
        lib.nft_ctx_new.restype = ctypes.c_void_p
        lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
        lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.nft_ctx_buffer_output.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_buffer_error.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_output_buffer.restype = ctypes.c_char_p
        lib.nft_ctx_get_output_buffer.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_error_buffer.restype = ctypes.c_char_p
        lib.nft_ctx_get_error_buffer.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_output_set_flags.argtypes = [ctypes.c_void_p, ctypes.c_uint]
        with _LOCK:
            self._ctx = lib.nft_ctx_new(0)
            lib.nft_ctx_buffer_output(self._ctx)
            lib.nft_ctx_buffer_error(self._ctx)

    def run(self, commands: str, *, json_output: bool = False) -> str:
        """Run nft commands (one transaction); raise with nft's message."""
        with _LOCK:
            self._lib.nft_ctx_output_set_flags(self._ctx, 1 << 4 if json_output else 0)
            rc = self._lib.nft_run_cmd_from_buffer(self._ctx, commands.encode())
            out = (self._lib.nft_ctx_get_output_buffer(self._ctx) or b"").decode()
            err = (self._lib.nft_ctx_get_error_buffer(self._ctx) or b"").decode()
        if rc != 0:
            raise Unavailable(f"nftables refused: {err.strip()[:800]}")
        return out

    def json(self, command: str) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads(self.run(command, json_output=True) or "{}")
        return doc
