"""What an anchor's F looks like: its scale and how concentrated its mass is (metadata, card, CLI)."""

from collections import defaultdict
from collections.abc import Mapping

import torch

from ..ops.order_statistics import float64_sum, order_statistics, rank_of_fraction, top_rank

TOP_FRACTIONS = (("0.1%", 0.001), ("1%", 0.01), ("5%", 0.05))  # the top sets reported by inspect and compare


def fisher_statistics(fisher: Mapping[str, torch.Tensor]) -> dict:
    """Size, scale and concentration of F: parameter count n, total mass sum_i F_i, mean, max,
    the 99th percentile `p99` = the k-th smallest F with k = ceil(0.99 n) (lam = 1 / p99 halves every
    top-1% coordinate's displacement per step), and the share of the mass held by the top ceil(0.01 n)
    coordinates. Streamed over the tensors one at a time (`ops.order_statistics`): no concatenation, no
    float64 copy, extra memory a few chunks whatever the anchor's size."""
    found = order_statistics(fisher.values(), lambda n: [rank_of_fraction(0.99, n), top_rank(0.01, n), n])
    (p99, _, largest), (_, top, _) = found.values, found.tail_sums
    return {
        "num_parameters": found.count,
        "total_mass": found.total,
        "mean": found.total / found.count,
        "max": largest,
        "p99": p99,
        "top1pct_mass_share": top / found.total if found.total > 0 else 0.0,
    }


def module_type_masses(fisher: Mapping[str, torch.Tensor]) -> dict[str, tuple[float, int]]:
    """Per module type, (sum of F, coordinate count), the type being the name of the parameter's module
    (e.g. `q_proj`, `embed_tokens`, `input_layernorm`; the parameter's own name for a top-level one)."""
    mass: defaultdict[str, float] = defaultdict(float)
    count: defaultdict[str, int] = defaultdict(int)
    for name, tensor in fisher.items():
        parts = name.split(".")
        kind = parts[-2] if len(parts) > 1 else parts[-1]
        mass[kind] += float64_sum([tensor])
        count[kind] += tensor.numel()
    return {kind: (mass[kind], count[kind]) for kind in mass}


def concentration(fisher: Mapping[str, torch.Tensor]) -> dict:
    """Share of the total mass in the top 0.1 / 1 / 5% of coordinates (the sum of the top ceil(q n) values
    over sum_i F_i, ties counted exactly; streamed as `fisher_statistics`), and per module type
    (`module_type_masses`)."""
    found = order_statistics(fisher.values(), lambda n: [top_rank(q, n) for _, q in TOP_FRACTIONS])
    total = found.total or 1.0
    top = {label: tail / total for (label, _), tail in zip(TOP_FRACTIONS, found.tail_sums, strict=True)}
    return {"top_shares": top, "module_types": module_type_shares(fisher)}


def module_type_shares(fisher: Mapping[str, torch.Tensor]) -> list[dict]:
    """Per module type (`module_type_masses`), largest mass first: {"type", "share": the type's sum of F over
    sum_i F_i (0 when F is all zero), "count": its coordinates}. One float64 sum per tensor, no sort: cheap
    enough to be kept in every anchor's metadata (`metadata["module_types"]`, read by `hf-cfp inspect`)."""
    masses = module_type_masses(fisher)
    total = sum(mass for mass, _ in masses.values()) or 1.0
    kinds = sorted(masses, key=lambda k: -masses[k][0])
    return [{"type": k, "share": masses[k][0] / total, "count": masses[k][1]} for k in kinds]
