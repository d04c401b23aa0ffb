"""HTTP/2 cleartext beside HTTP/1.1, on the same port.

A connection whose first bytes are HTTP/2's preface (prior knowledge: what
gRPC and Connect clients send over plain TCP) is served by uvicorn's own
HTTP/2 protocol (zttp); every other connection by uvicorn's httptools
HTTP/1.1 parser, as before, so the HTTP/1.1 path is the one measured in
bench/. h2c by `Upgrade: h2c` is not offered: such a client stays on
HTTP/1.1, which RFC 9113 lets it.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.auto_zttp_impl import AutoZttpProtocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.http.zttp_h2_impl import ZttpH2Protocol


class H2cOrHttp11(AutoZttpProtocol):
    """uvicorn's sniffing of the first bytes (AutoZttpProtocol), with
    httptools, not zttp, for HTTP/1.1."""

    def _switch(self, http2: bool, initial_data: bytes = b"") -> None:
        protocol_class: type[asyncio.Protocol] = ZttpH2Protocol if http2 else HttpToolsProtocol
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
