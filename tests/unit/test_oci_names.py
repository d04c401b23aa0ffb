"""Layer tarballs' member names (images/oci.py `_rel`): a leading "./"
or "/" is a prefix to remove, never a set of characters, so a root-level
whiteout (".wh.build"), opaque marker or dotfile keeps its name."""

from __future__ import annotations

import pytest

from corral.images.oci import _rel

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("member", "rel"),
    [
        ("./etc/passwd", "etc/passwd"),
        ("/etc/passwd", "etc/passwd"),
        ("etc/passwd", "etc/passwd"),
        ("./.wh.build", ".wh.build"),
        (".wh.build", ".wh.build"),
        ("./.wh..wh..opq", ".wh..wh..opq"),
        ("./.profile", ".profile"),
        ("..data", "..data"),
        ("././x", "x"),
        ("/./x", "x"),
        (".", ""),
        ("./", ""),
        ("/", ""),
    ],
)
def test_a_member_name_loses_its_prefix_only(member: str, rel: str) -> None:
    assert _rel(member) == rel
