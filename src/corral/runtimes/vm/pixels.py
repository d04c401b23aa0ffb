"""Screenshots cut and scaled on the host: a region of the screen, a
smaller copy of it, as a PNG.

QEMU dumps the framebuffer as PPM (raw RGB rows) or PNG. A cut or scaled
shot starts from the PPM, so no PNG is decoded: rows are byte slices and
columns are picked by one C-level gather per row (itemgetter), which keeps
a 1280x800 screen well under the latency an agent's step notices, with no
imaging library. Scaling is nearest-neighbour: what an agent sees at a
smaller size is what a pixel there stands for, without blended colours
that are on no screen.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from operator import itemgetter

from corral.errors import InvalidArgument

MIN_PERCENT = 5
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@dataclass(frozen=True)
class Rgb:
    """An RGB image: `height` rows of `width * 3` bytes each."""

    width: int
    height: int
    data: bytes

    def row(self, y: int) -> bytes:
        stride = self.width * 3
        return self.data[y * stride : (y + 1) * stride]


@dataclass(frozen=True)
class Region:
    """A rectangle of the screen, in screen pixels."""

    x: int
    y: int
    width: int
    height: int

    def check(self, screen: tuple[int, int]) -> None:
        """Raises InvalidArgument, naming the field, unless the region is
        a non-empty rectangle inside the screen."""
        w, h = screen
        if not 0 <= self.x < w:
            raise InvalidArgument("x", f"must be within the screen's width 0..{w - 1}", self.x)
        if not 0 <= self.y < h:
            raise InvalidArgument("y", f"must be within the screen's height 0..{h - 1}", self.y)
        if not 1 <= self.width <= w - self.x:
            raise InvalidArgument(
                "width", f"must be 1..{w - self.x} (the region ends at the screen's edge)",
                self.width,
            )  # fmt: skip
        if not 1 <= self.height <= h - self.y:
            raise InvalidArgument(
                "height", f"must be 1..{h - self.y} (the region ends at the screen's edge)",
                self.height,
            )  # fmt: skip


def check_percent(percent: int) -> None:
    if not MIN_PERCENT <= percent <= 100:
        raise InvalidArgument(
            "percent", f"must be {MIN_PERCENT}..100 (the screenshot's size, 100: full)", percent
        )


def parse_ppm(data: bytes) -> Rgb:
    """A binary PPM (P6, maxval 255) as QEMU's screendump writes it."""
    fields: list[bytes] = []
    pos = 0
    while len(fields) < 4:  # magic, width, height, maxval; '#' comments allowed
        while pos < len(data) and data[pos : pos + 1].isspace():
            pos += 1
        if data[pos : pos + 1] == b"#":
            pos = data.index(b"\n", pos) + 1
            continue
        end = pos
        while end < len(data) and not data[end : end + 1].isspace():
            end += 1
        if end == pos:
            raise ValueError("truncated PPM header")
        fields.append(data[pos:end])
        pos = end
    if fields[0] != b"P6" or fields[3] != b"255":
        raise ValueError("not an 8-bit binary PPM")
    width, height = int(fields[1]), int(fields[2])
    pixels = data[pos + 1 : pos + 1 + width * height * 3]  # one whitespace after maxval
    if len(pixels) != width * height * 3:
        raise ValueError("truncated PPM data")
    return Rgb(width, height, pixels)


XWD_HEADER = struct.Struct(">25I")  # XWDFileHeader: 25 CARD32, then the window's name
XWD_MAX_SIDE = 8192


def parse_xwd(data: bytes) -> Rgb:
    """Xvfb's screen file (-fbdir): an XWD image of 32-bit TrueColor
    pixels. The file comes from inside a sandbox: every size is checked
    against the data before it is used."""
    if len(data) < XWD_HEADER.size:
        raise ValueError("truncated XWD header")
    f = XWD_HEADER.unpack_from(data)
    header_size, version, fmt, depth, width, height = f[0], f[1], f[2], f[3], f[4], f[5]
    byte_order, bpp, stride = f[7], f[11], f[12]
    red, green, blue, ncolors = f[14], f[15], f[16], f[19]
    if version != 7 or fmt != 2 or depth != 24 or bpp != 32:
        raise ValueError(f"not a 24-bit ZPixmap XWD (version {version}, depth {depth}, {bpp} bpp)")
    if (red, green, blue) != (0xFF0000, 0xFF00, 0xFF):
        raise ValueError(f"unexpected XWD colour masks {red:#x} {green:#x} {blue:#x}")
    if not (1 <= width <= XWD_MAX_SIDE and 1 <= height <= XWD_MAX_SIDE) or stride < 4 * width:
        raise ValueError(f"bad XWD geometry {width}x{height}, {stride} bytes a line")
    start = header_size + 12 * ncolors  # the colormap: 12 bytes an entry
    if header_size < XWD_HEADER.size or start + stride * height > len(data):
        raise ValueError("truncated XWD data")
    px = data[start : start + stride * height]
    if stride != 4 * width:
        px = b"".join(px[y * stride : y * stride + 4 * width] for y in range(height))
    # 0x00RRGGBB in the file's byte order: LSBFirst is B, G, R, X.
    r, g, b = (2, 1, 0) if byte_order == 0 else (1, 2, 3)
    rgb = bytearray(width * height * 3)
    rgb[0::3] = px[r::4]
    rgb[1::3] = px[g::4]
    rgb[2::3] = px[b::4]
    return Rgb(width, height, bytes(rgb))


def cut(image: Rgb, region: Region) -> Rgb:
    stride, start = image.width * 3, region.x * 3
    rows = [
        image.data[y * stride + start : y * stride + start + region.width * 3]
        for y in range(region.y, region.y + region.height)
    ]
    return Rgb(region.width, region.height, b"".join(rows))


def scaled(image: Rgb, percent: int) -> Rgb:
    """Nearest-neighbour: output pixel (i, j) is the source pixel whose
    centre is nearest the centre of (i, j) mapped back."""
    if percent >= 100:
        return image
    width = max(1, round(image.width * percent / 100))
    height = max(1, round(image.height * percent / 100))
    xs = [min(image.width - 1, int((i + 0.5) * image.width / width)) for i in range(width)]
    pick = itemgetter(*[3 * x + c for x in xs for c in range(3)])
    rows: list[bytes] = []
    for j in range(height):
        y = min(image.height - 1, int((j + 0.5) * image.height / height))
        picked = pick(image.row(y))
        rows.append(bytes(picked) if isinstance(picked, tuple) else bytes([picked]))
    return Rgb(width, height, b"".join(rows))


def png(image: Rgb, level: int = 3) -> bytes:
    """Encode as an 8-bit RGB PNG (filter 0 on every row: desktop screens
    are flat colour that zlib compresses well without a predictor)."""
    stride = image.width * 3
    raw = b"".join(b"\x00" + image.data[y * stride : (y + 1) * stride] for y in range(image.height))

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )

    header = struct.pack(">IIBBBBB", image.width, image.height, 8, 2, 0, 0, 0)
    return (
        PNG_SIGNATURE
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw, level))
        + chunk(b"IEND", b"")
    )


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk."""
    if len(data) < 24 or data[:8] != PNG_SIGNATURE or data[12:16] != b"IHDR":
        raise ValueError("not a PNG")
    w, h = struct.unpack(">II", data[16:24])
    return int(w), int(h)


def distinct_colours(image: Rgb, at_most: int, step: int = 7) -> int:
    """How many different colours a sparse sample of the screen shows,
    counting up to `at_most`: a drawn desktop shows several, a screen
    still black (or one colour) one."""
    seen: set[bytes] = set()
    n = image.width * image.height
    for i in range(0, n, step):
        seen.add(image.data[3 * i : 3 * i + 3])
        if len(seen) >= at_most:
            break
    return len(seen)


def rows_changed(a: Rgb, b: Rgb) -> int:
    """How many pixel rows differ between two frames (all of them when
    their sizes do): a blinking text cursor changes one cell's rows, a
    new screen most of them."""
    if (a.width, a.height) != (b.width, b.height):
        return max(a.height, b.height)
    if a.data == b.data:
        return 0
    return sum(1 for y in range(a.height) if a.row(y) != b.row(y))
