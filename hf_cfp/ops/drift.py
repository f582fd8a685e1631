"""Drift of the path from theta0, Delta = theta - theta0 (pure tensor math).

    sensitive drift  sqrt(sum_i F_i Delta_i^2)
    free drift       ||Delta|| over the coordinates with F_i <= threshold, the threshold being
                     the k-th smallest F with k = ceil(free_fraction * n), fixed once at bind
    total drift      ||Delta||

Functions return squared sums so that sharded callers can add them across ranks first.
"""

from collections.abc import Sequence

import torch

from .order_statistics import order_statistics, rank_of_fraction


def _sum_of_squares(tensors: Sequence[torch.Tensor]) -> float:
    if not tensors:
        return 0.0
    norms = torch._foreach_norm(list(tensors))
    return float(torch.stack([n.double().cpu() for n in norms]).square().sum())


def total_drift_sq(deltas: Sequence[torch.Tensor]) -> float:
    """sum_i Delta_i^2."""
    return _sum_of_squares(deltas)


def sensitive_drift_sq(deltas: Sequence[torch.Tensor], fisher: Sequence[torch.Tensor]) -> float:
    """sum_i F_i Delta_i^2 (0 over no tensors)."""
    if not deltas:
        return 0.0
    return _sum_of_squares(torch._foreach_mul(list(deltas), torch._foreach_sqrt(list(fisher))))


def free_drift_sq(deltas: Sequence[torch.Tensor], fisher: Sequence[torch.Tensor], threshold: float) -> float:
    """sum of Delta_i^2 over coordinates with F_i <= threshold."""
    return _sum_of_squares([torch.where(f <= threshold, d, 0.0) for d, f in zip(deltas, fisher, strict=True)])


def free_threshold(fisher: Sequence[torch.Tensor], free_fraction: float) -> float:
    """The k-th smallest Fisher value, k = max(1, ceil(free_fraction * n)): coordinates at or below it are 'free'.

    With ties at the threshold slightly more than `free_fraction` of the coordinates count as free. Selected
    exactly by streaming over the tensors one at a time (`order_statistics`), never concatenating them.
    """
    return order_statistics(fisher, lambda n: [rank_of_fraction(free_fraction, n)]).values[0]
