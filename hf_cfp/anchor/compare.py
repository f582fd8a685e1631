"""How alike two Fishers over the same parameters are: top-set overlap, cosine, mass per module type.

Used by `hf-cfp compare` (two capabilities, two sample sizes, two revisions of a model) and by
`estimate_fisher`'s split-half reliability (the two halves of the calibration sequences).
"""

import math
from collections.abc import Mapping, Sequence

import torch

from ..errors import AnchorMismatchError
from ..ops.order_statistics import float64_sum, order_statistics, rank_of_fraction, top_rank
from .kfac_views import ImpliedDiagonal, factor_cosines
from .protocol import NamedFisher
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


def top_mask(tensors: Sequence[torch.Tensor], fraction: float) -> torch.Tensor:
    """T(F): a flat boolean mask of the k = ceil(fraction * n) largest coordinates of the tensors taken in
    order and flattened; ties at the k-th largest value are broken by the lower flat index. The k-th largest
    is selected by streaming (`ops.order_statistics`); the tensors are never concatenated, only the mask is
    built (n bytes)."""
    kth = order_statistics(tensors, lambda n: [top_rank(fraction, n)]).values[0]
    flats = [t.detach().reshape(-1) for t in tensors]
    mask = torch.empty(sum(f.numel() for f in flats), dtype=torch.bool, device=flats[0].device)
    for flat, part in zip(flats, mask.split([f.numel() for f in flats]), strict=True):
        torch.gt(flat, kth, out=part)
    need = rank_of_fraction(fraction, mask.numel()) - int(mask.sum())  # ties at kth to take, lowest index first
    for flat, part in zip(flats, mask.split([f.numel() for f in flats]), strict=True):
        tied = (flat == kth).nonzero().squeeze(1)[:need]
        part[tied] = True
        need -= tied.numel()
    return mask


def top_overlap(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], fraction: float) -> float:
    """|T(a) ∩ T(b)| / |T|, T the top ceil(fraction * n) coordinate set of `top_mask`."""
    mask_a = top_mask(a, fraction)
    mask_b = top_mask(b, fraction).to(mask_a.device)
    return int((mask_a & mask_b).sum()) / int(mask_a.sum())


def cosine(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """<a, b> / sqrt(<a, a> <b, b>) over the flattened tensors, in float64 (nan if either is all zero).
    Written with one square root, so an F against itself gives exactly 1."""
    dot = aa = bb = 0.0
    for x, y in zip(a, b, strict=True):
        x, y = x.detach().double(), y.detach().double().to(x.device)
        dot, aa, bb = dot + float((x * y).sum()), aa + float((x * x).sum()), bb + float((y * y).sum())
    return dot / math.sqrt(aa * bb) if aa > 0 and bb > 0 else math.nan


def split_half(first_sums: Sequence[torch.Tensor], second_sums: Sequence[torch.Tensor], n_first: int, n_second: int):
    """Split-half reliability from the squared-score sums of two halves of the sequences, F_a = S_a / N_a and
    F_b = S_b / N_b: {"top1pct_overlap": |T1(F_a) ∩ T1(F_b)| / |T1| (T1 the top 1%; a set does not change
    with the scale, so it is taken on the sums), "mass_relative_difference": |M_a - M_b| / ((M_a + M_b) / 2)
    with M = sum_i F_i (0 when both are 0), "num_sequences": [N_a, N_b]}."""
    mass_a = float64_sum(first_sums) / n_first
    mass_b = float64_sum(second_sums) / n_second
    return {
        "top1pct_overlap": top_overlap(first_sums, second_sums, 0.01),
        "mass_relative_difference": abs(mass_a - mass_b) / ((mass_a + mass_b) / 2) if mass_a + mass_b > 0 else 0.0,
        "num_sequences": [n_first, n_second],
    }


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
