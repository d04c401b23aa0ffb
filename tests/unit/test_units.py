from __future__ import annotations

import pytest

from corral.errors import InvalidArgument
from corral.units import format_size, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (4096, 4096),
        ("4096", 4096),
        ("1KiB", 1024),
        ("1k", 1000),
        ("512MiB", 512 * 2**20),
        ("1.5GiB", int(1.5 * 2**30)),
        ("2G", 2 * 10**9),
        (" 3 mib ", 3 * 2**20),
        (0, 0),
    ],
)
def test_sizes(text: object, expected: int) -> None:
    assert parse_size(text, "memory") == expected


@pytest.mark.parametrize("bad", ["lots", "-1GiB", "1 parsec", "", None, True, -5, [1], "1e9"])
def test_bad_sizes_name_the_field_and_value(bad: object) -> None:
    with pytest.raises(InvalidArgument) as exc:
        parse_size(bad, "memory")
    assert exc.value.field == "memory"
    assert exc.value.value == bad


def test_format_size() -> None:
    assert format_size(512) == "512 B"
    assert format_size(1536) == "1.5 KiB"
    assert format_size(3 * 2**30) == "3.0 GiB"
