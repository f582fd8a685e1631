"""The diagonal geometry's sparse correction: only the coordinates carrying the top share of each protecting anchor's
F are corrected.

Anchor k keeps the coordinates with F_{k,i} > t_k, its threshold over its full F (the same on every process):

    by coordinates, share s:   t_k = the ceil((1 - s) n)-th smallest F_k     (at most s n coordinates kept)
    by mass, share m:          t_k = the largest t with sum_{F_{k,i} > t} F_{k,i} >= m sum_i F_{k,i}

and a coordinate is corrected when some anchor keeps it. Every other coordinate keeps the optimizer's proposal,
as if its F were 0; `SparseReport` says what that leaves out: the share of each anchor's mass kept, and the
largest F it drops (lam times it is the strongest pull not applied).
"""

import math
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from ...ops import flat, free_threshold, proximal_pull_, spans


def coordinate_threshold(fisher: Sequence[torch.Tensor], share: float) -> float:
    """t with F > t on at most ceil(share n) coordinates: the ceil((1 - share) n)-th smallest F."""
    return free_threshold(fisher, 1.0 - share)


def mass_threshold(fisher: Sequence[torch.Tensor], share: float) -> float:
    """The largest t with sum_{F_i > t} F_i >= share * sum_i F_i, by bisection over the bit patterns of
    non-negative float32 t (which order as the integers they spell): 31 passes over the tensors, one at a time
    (each a read of the whole anchor: slower than the coordinate share's two passes, `coordinate_threshold`)."""

    def above(t: float) -> float:
        return sum(float(f[f > t].double().sum()) for f in fisher)

    target = share * above(0.0)  # F >= 0: the mass above 0 is the total
    if target <= 0:
        return math.inf  # F = 0 everywhere: nothing carries mass
    low, high = 0, 0x7F800000  # the bit patterns of 0.0 and +inf
    while high - low > 1:  # invariant: above(bits(low)) >= target > above(bits(high))
        middle = (low + high) // 2
        if above(_float(middle)) >= target:
            low = middle
        else:
            high = middle
    return _float(low)


def _float(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


@dataclass(frozen=True)
class SparseReport:
    """Per protecting anchor: its threshold t_k, the share of its total mass on the corrected coordinates, and the
    largest F among the coordinates left uncorrected (0 when none is)."""

    thresholds: list[float]
    mass_kept: list[float]
    largest_dropped: list[float]
    kept: int  # corrected coordinates
    covered: int  # protected coordinates


def sparse_report(rows: Iterable[Sequence[torch.Tensor | None]], thresholds: Sequence[float]) -> SparseReport:
    """What the thresholds keep, over full F rows (`rows[i][k]`: anchor k's full F on protected tensor i), visited
    one row at a time."""
    kept_mass = [0.0] * len(thresholds)
    total_mass = [0.0] * len(thresholds)
    dropped = [0.0] * len(thresholds)
    kept = covered = 0
    for row in rows:
        mask = _kept(row, thresholds)
        kept += int(mask.sum())
        covered += mask.numel()
        for k, fisher in enumerate(row):
            if fisher is not None:
                values = fisher.reshape(-1)
                total_mass[k] += float(values.double().sum())
                kept_mass[k] += float(values[mask].double().sum())
                if not bool(mask.all()):
                    dropped[k] = max(dropped[k], float(values[~mask].max()))
    shares = [m / t if t > 0 else 1.0 for m, t in zip(kept_mass, total_mass, strict=True)]
    return SparseReport(list(thresholds), shares, dropped, kept, covered)


def describe_sparse(report: SparseReport, anchors: Sequence[str], lams: Sequence[float] | None = None) -> str:
    """One line: how many protected coordinates are corrected, and per anchor the mass kept and the largest F
    dropped (with constant `lams`, the largest lam F dropped: the strongest pull left out)."""
    dropped = [
        f"largest F dropped {f:.3g}" + (f" (lam F = {f * lams[k]:.3g})" if lams is not None else "")
        for k, f in enumerate(report.largest_dropped)
    ]
    per_anchor = "; ".join(
        f"{name!r} keeps {kept:.1%} of its mass, {left}"
        for name, kept, left in zip(anchors, report.mass_kept, dropped, strict=True)
    )
    share = report.kept / report.covered if report.covered else 0.0
    return (
        f"CFP sparse: correcting {report.kept:,} of {report.covered:,} protected coordinates ({share:.2%}); "
        f"{per_anchor}. Every other coordinate keeps the optimizer's proposal."
    )


def _kept(row: Sequence[torch.Tensor | None], thresholds: Sequence[float]) -> torch.Tensor:
    """The flat mask of coordinates some anchor keeps (F_k > t_k)."""
    masks = [f.reshape(-1) > t for f, t in zip(row, thresholds, strict=True) if f is not None]
    mask = masks[0]
    for other in masks[1:]:
        mask = mask | other
    return mask


class SparseCorrection:
    """The kept coordinates of each protected tensor, on the parameter's device: their flat indices (int32 when
    they fit), theta0 and each anchor's F there; the correction gathers them, pulls, and scatters them back."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        theta0: Sequence[torch.Tensor],
        rows: Sequence[Sequence[torch.Tensor | None]],
        thresholds: Sequence[float],
    ):
        self.indices: list[torch.Tensor] = []
        self.theta0: list[torch.Tensor] = []
        self.rows: list[list[torch.Tensor | None]] = []
        for param, start, row in zip(params, theta0, rows, strict=True):
            index = _kept_indices(row, thresholds)
            device = param.device
            self.theta0.append(start.reshape(-1)[index].to(device))
            self.rows.append([f.reshape(-1)[index].to(device) if f is not None else None for f in row])
            small = param.numel() < 2**31
            self.indices.append(index.to(device, torch.int32 if small else torch.int64))

    def correct(self, params: Sequence[torch.Tensor], lams: Sequence[float]) -> None:
        """Pull the kept coordinates of `params` (the local tensors of the bound parameters) toward theta0: gathered
        by index, pulled together (`proximal_pull_` packs them), scattered back."""
        with torch.no_grad():
            values = [flat(param)[index] for param, index in zip(params, self.indices, strict=True)]
            proximal_pull_(values, self.theta0, self.rows, lams)
            for param, index, kept in zip(params, self.indices, values, strict=True):
                flat(param)[index] = kept


def _kept_indices(row: Sequence[torch.Tensor | None], thresholds: Sequence[float]) -> torch.Tensor:
    """Flat indices (int64, on F's device) of the coordinates some anchor keeps, found a span at a time."""
    flats = [f.reshape(-1) if f is not None else None for f in row]
    numel = next(f for f in flats if f is not None).numel()
    found = [
        _kept([f[span] if f is not None else None for f in flats], thresholds).nonzero().squeeze(1) + span.start
        for span in spans(numel)
    ]
    return torch.cat(found) if found else torch.zeros(0, dtype=torch.int64)
