"""HTTP/2 cleartext beside HTTP/1.1, on the same port.

A connection whose first bytes are HTTP/2's preface (prior knowledge: what
gRPC and Connect clients send over plain TCP) is served by uvicorn's own
HTTP/2 protocol (zttp); every other connection by uvicorn's httptools
HTTP/1.1 parser, as before, so the HTTP/1.1 path is the one measured in
bench/. h2c by `Upgrade: h2c` is not offered: such a client stays on
HTTP/1.1, which RFC 9113 lets it.

On HTTP/1.1 an app may also reset its connection (TCP RST) through the
scope extension RESET: what a client must see when the stream it reads is
dropped (E2B's clients read a reset as the transport error it is, but a
clean close mid-chunk as a protocol error).
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Mapping
from typing import Any

from uvicorn.protocols.http.auto_zttp_impl import AutoZttpProtocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.http.zttp_h2_impl import ZttpH2Protocol

RESET = "corral.reset"  # scope["extensions"][RESET](): reset this connection


def reset_of(scope: Mapping[str, Any]) -> Any:
    """The scope's reset, or None (HTTP/2, a unix socket's plain server)."""
    extensions = scope.get("extensions")
    return extensions.get(RESET) if isinstance(extensions, dict) else None


class _Http11(HttpToolsProtocol):
    """uvicorn's httptools HTTP/1.1, offering each request RESET."""

    def on_message_begin(self) -> None:
        super().on_message_begin()
        extensions: dict[str, Any] = dict(self.scope.get("extensions") or {})
        extensions[RESET] = self._reset
        self.scope["extensions"] = extensions

    def _reset(self) -> None:
        sock = self.transport.get_extra_info("socket")
        if sock is not None:  # linger 0: close sends RST, not FIN
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()


class H2cOrHttp11(AutoZttpProtocol):
    """uvicorn's sniffing of the first bytes (AutoZttpProtocol), with
    httptools, not zttp, for HTTP/1.1."""

    def _switch(self, http2: bool, initial_data: bytes = b"") -> None:
        protocol_class: type[asyncio.Protocol] = ZttpH2Protocol if http2 else _Http11
        protocol = protocol_class(  # type: ignore[call-arg]
            config=self.config,
            server_state=self.server_state,
            app_state=self.app_state,
            _loop=self.loop,
        )
        self.transport.set_protocol(protocol)
        protocol.connection_made(self.transport)
        if initial_data:
            protocol.data_received(initial_data)
