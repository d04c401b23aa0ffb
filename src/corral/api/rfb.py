"""The viewer's half of an RFB (VNC) stream, read message by message, so
a read-only view can pass what asks to see and drop what would type or
click.

Client-to-server RFB (RFC 6143 section 7.5, and QEMU's extensions): after
the handshake (the 12-byte version, the chosen security type on 3.7+, the
1-byte ClientInit) every message starts with its type, which fixes its
length. A read-only view forwards SetPixelFormat, SetEncodings,
FramebufferUpdateRequest, EnableContinuousUpdates and fences; it drops
KeyEvent, PointerEvent, ClientCutText and QEMU's extended key event; any
other message ends the view (a stream we cannot frame cannot be filtered).
The handshake's ClientInit is forced to "shared", so no viewer can ask
QEMU to disconnect the others.
"""

from __future__ import annotations

import struct

from corral.errors import InvalidArgument

HANDSHAKE, MESSAGES = "handshake", "messages"

# Message type -> its fixed part in bytes (a variable part follows for some).
_FIXED = {0: 20, 2: 4, 3: 10, 4: 8, 5: 6, 6: 8, 150: 10, 248: 9, 255: 2}
_INPUT = {4, 5, 6}  # key, pointer, clipboard
MAX_CUT = 1 << 20  # a viewer's clipboard text (an unbounded length would stall the stream)


class ViewerStream:
    """Feed it what the viewer sent; it returns what QEMU may get.
    `interactive` passes every message (framed all the same)."""

    def __init__(self, interactive: bool) -> None:
        self.interactive = interactive
        self.buf = b""
        self.stage = HANDSHAKE
        self.version: bytes | None = None
        self.security_chosen = False
        self.inputs = 0  # input messages passed since the caller last reset it

    def feed(self, data: bytes) -> bytes:
        self.buf += data
        out = bytearray()
        while True:
            piece = self._next()
            if piece is None:
                return bytes(out)
            out += piece

    def _take(self, n: int) -> bytes | None:
        if len(self.buf) < n:
            return None
        head, self.buf = self.buf[:n], self.buf[n:]
        return head

    def _next(self) -> bytes | None:
        if self.stage == HANDSHAKE:
            return self._handshake()
        if not self.buf:
            return None
        kind = self.buf[0]
        size = self._size(kind)
        if size is None:
            return None
        msg = self._take(size)
        if msg is None:
            return None
        is_input = kind in _INPUT or (kind == 255 and msg[1] == 0)
        if not is_input:
            return msg
        if not self.interactive:
            return b""
        self.inputs += 1
        return msg

    def _size(self, kind: int) -> int | None:
        """The whole message's length, or None until enough has arrived."""
        fixed = _FIXED.get(kind)
        if fixed is None:
            raise InvalidArgument("rfb", "must be RFB client messages a view can frame", kind)
        if len(self.buf) < fixed:
            return None
        if kind == 2:  # SetEncodings: u16 count of s32 encodings
            return fixed + 4 * int(struct.unpack(">H", self.buf[2:4])[0])
        if kind == 6:  # ClientCutText: s32 length; negative: the extended
            # clipboard's message of -length bytes (noVNC sends its caps so)
            length = abs(int(struct.unpack(">i", self.buf[4:8])[0]))
            if length > MAX_CUT:
                raise InvalidArgument("rfb", f"must carry at most {MAX_CUT} bytes of text", length)
            return fixed + length
        if kind == 248:  # ClientFence: u8 length of payload at offset 8
            return fixed + self.buf[8]
        if kind == 255:  # QEMU client message: subtype 0 is the extended key event
            if self.buf[1] != 0:
                raise InvalidArgument("rfb", "must be QEMU key events (subtype 0)", self.buf[1])
            return 12
        return fixed

    def _handshake(self) -> bytes | None:
        if self.version is None:
            version = self._take(12)
            if version is None:
                return None
            if not version.startswith(b"RFB 003.") or not version.endswith(b"\n"):
                raise InvalidArgument("rfb", "must start with an RFB 3.x version", version)
            self.version = version
            return version
        if self.version != b"RFB 003.003\n" and not self.security_chosen:
            choice = self._take(1)
            if choice is None:
                return None
            self.security_chosen = True
            return choice
        client_init = self._take(1)
        if client_init is None:
            return None
        self.stage = MESSAGES
        return b"\x01"  # shared: never exclusive
