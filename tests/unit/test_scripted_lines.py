"""A scripted build's progress reads whole lines from output that comes in
chunks: a "step:" line split across chunks still counts once."""

from __future__ import annotations

import pytest

from corral.build.scripted import _Lines


@pytest.mark.parametrize(
    ("chunks", "lines"),
    [
        (["step: a\n"], ["step: a"]),
        (["st", "ep: a\nb", "\n"], ["step: a", "b"]),
        (["a\n\nb"], ["a", "", "b"]),  # the last part line comes out at flush
        (["", "x", ""], ["x"]),
        ([], []),
    ],
)
def test_chunks_become_lines(chunks: list[str], lines: list[str]) -> None:
    got: list[str] = []
    split = _Lines(got.append)
    for c in chunks:
        split(c)
    split.flush()
    assert got == lines
