"""The Kronecker-factored (K-FAC) geometry: F_W ~ A (x) G for a Linear-like weight W (out x in), kept as the top
eigenpairs of each factor and a tail. Followed from estimate to anchor: the factor sums (`factors`, `sketch` for a
factor too wide to form) fed by the scoring pass into its sink (`sink`), their eigenbases stored in the anchor
(`artifact`: keys, checks, lazy reads, truncation) and read coordinate by coordinate (`views`); bound to a live
model (`binding`) and kept each step (`state`: the correction, drift, budget terms and footprint of its weights in
their eigenbases, `basis` and `proximal` the math; `flat` with `pieces`, weights held as flat pieces under FSDP1
and ZeRO-3; `master`, DeepSpeed's fp32 master fragments; `summed` with `summed_solve`, several protecting anchors on
one weight); its LoRA rules (`lora`)."""

import torch

from ..base import Bound, Geometry, GeometryState, NamedFisher
from .artifact import dense_factors
from .sink import KroneckerSink, kfac_weights
from .state import KroneckerTensors
from .summed import SummedTensors, summed_tensors


def _dense(anchor: NamedFisher, name: str) -> torch.Tensor | None:
    """G_r (x) A_r of weight `name` (row-major vec of its out x in matrix), float64, or None when it is not
    factored."""
    if name not in anchor.kfac:
        return None
    a, g = dense_factors(anchor.kfac[name])
    return torch.kron(g.double(), a.double())


def _states(bound: Bound) -> list[GeometryState]:
    """The weights protecting K-FAC anchors factor: each anchor's closed form where it alone protects a weight
    (`state.KroneckerTensors`), the summed penalty's solve where others protect it too (`summed.SummedTensors`)."""
    several = summed_tensors(bound.tracked, bound.protecting)
    return [
        KroneckerTensors(bound.views, bound.protecting, several),
        SummedTensors(several, bound.views, bound.protecting),
    ]


GEOMETRY = Geometry("kronecker", kfac_weights, KroneckerSink, _dense, _states)

__all__ = ["GEOMETRY", "KroneckerSink", "kfac_weights"]
