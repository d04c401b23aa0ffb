"""Sizes and durations as users write them ("512MiB", "1.5GiB", 4096)."""

from __future__ import annotations

import re

from corral.errors import InvalidArgument

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ki": 1024,
    "kib": 1024,
    "mi": 1024**2,
    "mib": 1024**2,
    "gi": 1024**3,
    "gib": 1024**3,
    "ti": 1024**4,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
SIZE_RULE = "must be a byte count or a size like '512MiB' or '2GiB'"


def parse_size(value: object, field: str) -> int:
    """Bytes from an int or a string with a unit; InvalidArgument otherwise."""
    if isinstance(value, bool):
        raise InvalidArgument(field, SIZE_RULE, value)
    if isinstance(value, int):
        if value < 0:
            raise InvalidArgument(field, "must not be negative", value)
        return value
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    if not isinstance(value, str):
        raise InvalidArgument(field, SIZE_RULE, value)
    m = _SIZE.match(value)
    if not m or m.group(2).lower() not in _UNITS:
        raise InvalidArgument(field, SIZE_RULE, value)
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_size(n: float) -> str:
    """A short human rendering: 1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


_DURATION = re.compile(r"(\d+)\s*([smhdw])")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(value: str) -> int | None:
    """Seconds from a duration as users write them ('30d', '1d12h'), or None
    when `value` is not one (a caller may then try a date)."""
    text = value.strip().lower()
    if not text or _DURATION.sub("", text).strip():
        return None
    return sum(int(n) * _SECONDS[u] for n, u in _DURATION.findall(text))
