"""What an anchor's F looks like: its scale and how concentrated its mass is (metadata, card, CLI)."""

import math
from collections import defaultdict
from collections.abc import Mapping

import torch

from ..ops import free_threshold

TOP_FRACTIONS = (("0.1%", 0.001), ("1%", 0.01), ("5%", 0.05))  # the top sets reported by inspect and compare


def _flat(fisher: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in fisher.values()]).double()


def fisher_statistics(fisher: Mapping[str, torch.Tensor]) -> dict:
    """Size, scale and concentration of F: parameter count n, total mass sum_i F_i, mean, max,
    the 99th percentile `p99` (lam = 1 / p99 halves every top-1% coordinate's displacement
    per step), and the share of the mass held by the top ceil(0.01 n) coordinates."""
    flat = _flat(fisher)
    total = float(flat.sum())
    top = flat.topk(max(1, math.ceil(0.01 * flat.numel()))).values
    return {
        "num_parameters": flat.numel(),
        "total_mass": total,
        "mean": total / flat.numel(),
        "max": float(flat.max()),
        "p99": free_threshold([flat], 0.99),
        "top1pct_mass_share": float(top.sum()) / total if total > 0 else 0.0,
    }


def module_type_masses(fisher: Mapping[str, torch.Tensor]) -> dict[str, tuple[float, int]]:
    """Per module type, (sum of F, coordinate count), the type being the name of the parameter's module
    (e.g. `q_proj`, `embed_tokens`, `input_layernorm`; the parameter's own name for a top-level one)."""
    mass: defaultdict[str, float] = defaultdict(float)
    count: defaultdict[str, int] = defaultdict(int)
    for name, tensor in fisher.items():
        parts = name.split(".")
        kind = parts[-2] if len(parts) > 1 else parts[-1]
        mass[kind] += float(tensor.double().sum())
        count[kind] += tensor.numel()
    return {kind: (mass[kind], count[kind]) for kind in mass}


def concentration(fisher: Mapping[str, torch.Tensor]) -> dict:
    """Share of the total mass in the top 0.1 / 1 / 5% of coordinates, and per module type
    (`module_type_masses`)."""
    flat = _flat(fisher)
    total = float(flat.sum()) or 1.0
    ordered = flat.sort(descending=True).values
    top = {label: float(ordered[: max(1, math.ceil(q * flat.numel()))].sum()) / total for label, q in TOP_FRACTIONS}
    masses = module_type_masses(fisher)
    kinds = sorted(masses, key=lambda k: -masses[k][0])
    types = [{"type": k, "share": masses[k][0] / total, "count": masses[k][1]} for k in kinds]
    return {"top_shares": top, "module_types": types}
