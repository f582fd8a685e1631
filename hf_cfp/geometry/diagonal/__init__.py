"""The diagonal geometry: F_i per coordinate. Its estimate sink (`sink`: per-sequence squared scores, split in
halves), its part of the anchor artifact (`artifact`: the values F may hold, F read lazily from the files); the
default geometry of every structure (`registry`), it takes every scored parameter no other geometry claims."""

from collections.abc import Sequence

from ..base import Geometry, Scored
from .sink import DiagonalSink


def _claim(scored: Sequence[Scored]) -> list[Scored]:
    """Every scored parameter: a diagonal F describes any tensor."""
    return list(scored)


GEOMETRY = Geometry("diagonal", _claim, DiagonalSink)

__all__ = ["GEOMETRY", "DiagonalSink"]
