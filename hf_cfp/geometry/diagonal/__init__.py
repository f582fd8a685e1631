"""The diagonal geometry: F_i per coordinate. Its estimate sink (`sink`: per-sequence squared scores, split in
halves), its part of the anchor artifact (`artifact`: the values F may hold, F read lazily from the files), its
binding (`binding`: each process's part of F), its per-step state (`state`: the elementwise correction, drift,
budget terms and footprint; `sparse`, the top share of F corrected); the default geometry of every structure
(`registry`), it takes every scored parameter no other geometry claims."""

from collections.abc import Sequence

import torch

from ..base import Bound, Geometry, GeometryState, NamedFisher, Scored
from .sink import DiagonalSink
from .state import DiagonalTensors


def _claim(scored: Sequence[Scored]) -> list[Scored]:
    """Every scored parameter: a diagonal F describes any tensor."""
    return list(scored)


def _dense(anchor: NamedFisher, name: str) -> torch.Tensor | None:
    """diag(F) of parameter `name`, float64, or None when the anchor keeps no diagonal F for it."""
    return torch.diag(anchor.fisher[name].double().reshape(-1)) if name in anchor.fisher else None


def _states(bound: Bound) -> list[GeometryState]:
    """The protected tensors with a diagonal F, and the drift of every tensor some anchor covers that way."""
    thresholds = {name: view.threshold for name, view in bound.views.items()}
    return [DiagonalTensors(bound.tracked, bound.protecting, thresholds, bound.sparse)]


GEOMETRY = Geometry("diagonal", _claim, DiagonalSink, _dense, _states)

__all__ = ["GEOMETRY", "DiagonalSink"]
