"""How alike two Fishers over the same parameters are: top-set overlap, cosine, mass per module type.

Used by `hf-cfp compare` (two capabilities, two sample sizes, two revisions of a model) and by
`estimate_fisher`'s split-half reliability (the two halves of the calibration sequences).
"""

import math
from collections.abc import Mapping, Sequence

import torch

from ..errors import AnchorMismatchError
from ..geometry.base import NamedFisher
from ..geometry.kronecker.views import ImpliedDiagonal, factor_cosines
from ..ops.order_statistics import top_overlap
from .statistics import TOP_FRACTIONS, module_type_masses


def layout_difference(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> str | None:
    """The first difference in tensor names or shapes between two Fisher dicts, in words; None if alike."""
    missing, extra = [n for n in a if n not in b], [n for n in b if n not in a]
    if missing:
        return f"parameter {missing[0]!r} is in the first but not the second ({len(missing)} such)"
    if extra:
        return f"parameter {extra[0]!r} is in the second but not the first ({len(extra)} such)"
    for name, tensor in a.items():
        if tensor.shape != b[name].shape:
            shapes = f"{tuple(tensor.shape)} in the first, {tuple(b[name].shape)} in the second"
            return f"parameter {name!r} has shape {shapes}"
    return None


def cosine(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """<a, b> / sqrt(<a, a> <b, b>) over the flattened tensors, in float64 (nan if either is all zero).
    Written with one square root, so an F against itself gives exactly 1."""
    dot = aa = bb = 0.0
    for x, y in zip(a, b, strict=True):
        x, y = x.detach().double(), y.detach().double().to(x.device)
        dot, aa, bb = dot + float((x * y).sum()), aa + float((x * x).sum()), bb + float((y * y).sum())
    return dot / math.sqrt(aa * bb) if aa > 0 and bb > 0 else math.nan


def compare_anchors(a: NamedFisher, b: NamedFisher) -> dict:
    """Two anchors over the same tensor names and shapes, with F_a, F_b flattened in a's tensor order:

    - `top_overlap`: |T(F_a) ∩ T(F_b)| / |T| for the top 0.1%, 1% and 5% coordinate sets (`top_mask`),
    - `cosine`: <F_a, F_b> / (||F_a|| ||F_b||) in float64,
    - `module_types`: each module type's share of the total mass sum_i F_i, for a and b (types as in
      `statistics.module_type_masses`: the parameter's module name, e.g. `q_proj`, `embed_tokens`),
      ordered by the larger of the two shares.

    Two K-FAC anchors are compared on the diagonal of A (x) G beside their diagonal F (`kfac_views.ImpliedDiagonal`:
    their eigenbases need not agree), and `factor_cosine` adds the mean cosine of their dense A and G factors.

    Raises AnchorMismatchError when the tensor names or shapes differ, or one anchor is K-FAC and the other not.
    """
    if bool(a.kfac) != bool(b.kfac):
        kfac, diagonal = (a, b) if a.kfac else (b, a)
        raise AnchorMismatchError(
            f"Anchor {kfac.name!r} is Kronecker-factored (structure 'kfac') and {diagonal.name!r} is diagonal: their "
            "coordinates do not correspond. Compare two anchors of one structure (estimate both with the same "
            "--structure)."
        )
    fisher_a, fisher_b = ImpliedDiagonal(a.fisher, a.kfac), ImpliedDiagonal(b.fisher, b.kfac)  # F itself if diagonal
    difference = layout_difference(fisher_a, fisher_b)
    if difference is not None:
        raise AnchorMismatchError(
            f"Anchors {a.name!r} and {b.name!r} cover different parameters: {difference}. Compare anchors "
            "estimated for the same base model with the same trainable parameters."
        )
    fa = list(fisher_a.values())
    fb = [fisher_b[name] for name in fisher_a]
    shares_a, shares_b = _shares(fisher_a), _shares(fisher_b)
    kinds = sorted(shares_a.keys() | shares_b.keys(), key=lambda k: -max(shares_a.get(k, 0.0), shares_b.get(k, 0.0)))
    return {
        "a": a.name,
        "b": b.name,
        "num_parameters": sum(t.numel() for t in fa),
        "top_overlap": {label: top_overlap(fa, fb, q) for label, q in TOP_FRACTIONS},
        "cosine": cosine(fa, fb),
        "module_types": [{"type": k, "share_a": shares_a.get(k, 0.0), "share_b": shares_b.get(k, 0.0)} for k in kinds],
        **({"factor_cosine": factor_cosines(a.kfac, b.kfac)} if a.kfac else {}),
    }


def _shares(fisher: Mapping[str, torch.Tensor]) -> dict[str, float]:
    masses = module_type_masses(fisher)
    total = sum(mass for mass, _ in masses.values()) or 1.0
    return {kind: mass / total for kind, (mass, _) in masses.items()}
