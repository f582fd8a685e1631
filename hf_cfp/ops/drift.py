"""Drift of the path from theta0, Delta = theta - theta0 (pure tensor math).

    sensitive drift  sqrt(sum_i F_i Delta_i^2)
    free drift       ||Delta|| over the coordinates with F_i <= threshold, the threshold being
                     the k-th smallest F with k = ceil(free_fraction * n), fixed once at bind
    total drift      ||Delta||

`drift_squares` returns squared sums so that sharded callers can add them across ranks first.
"""

from collections.abc import Sequence
from typing import NamedTuple

import torch

from .chunks import chunk_elements, spans, workspace
from .order_statistics import order_statistics, rank_of_fraction


class DriftView(NamedTuple):
    """One anchor's view of the tensors: its F on each (None where it does not cover one), and its free-drift
    threshold."""

    fishers: Sequence[torch.Tensor | None]
    threshold: float


def drift_squares(
    params: Sequence[torch.Tensor],
    theta0: Sequence[torch.Tensor | None],
    views: Sequence[DriftView],
    chunk: int | None = None,
) -> torch.Tensor:
    """float64 [1 + 2 V] on the CPU: sum_i Delta_i^2, then per view v, sum_i F_i Delta_i^2 and the sum of
    Delta_i^2 over its coordinates with F_i <= threshold, Delta = params - theta0, both sums of a view running
    over the tensors it covers (a None theta0 is 0: Delta = params).

    theta0 and F may live on another device than the parameter (offloaded to the CPU) and in any floating
    dtype: each span of at most `chunk` elements (default `chunk_elements(device)`) is copied into float32
    buffers on the parameter's device (`workspace`), so the temporaries are three chunks, never the model. Each
    chunk's sums are float32, added up in float64 per device.
    """
    if any(len(view.fishers) != len(params) for view in views):
        raise ValueError(f"drift_squares: every view needs one F (or None) per tensor, {len(params)} tensors.")
    sums: dict[torch.device, torch.Tensor] = {}
    with torch.no_grad():
        for i, (param, start) in enumerate(zip(params, theta0, strict=True)):
            device = param.device
            acc = sums.setdefault(device, torch.zeros(1 + 2 * len(views), dtype=torch.float64, device=device))
            param_flat = param.reshape(-1)
            start_flat = start.reshape(-1) if start is not None else None
            covering = [(v, f.reshape(-1)) for v, view in enumerate(views) if (f := view.fishers[i]) is not None]
            length = chunk or chunk_elements(device)
            square_buffer, origin_buffer, product_buffer = workspace(device, 3, length)
            for span in spans(param_flat.numel(), length):
                size = span.stop - span.start
                square = square_buffer[:size].copy_(param_flat[span])
                if start_flat is not None:
                    square.sub_(origin_buffer[:size].copy_(start_flat[span], non_blocking=True))
                square.square_()
                # float32 sums of one chunk (pairwise, accurate to ~1e-7), added up in float64
                acc[0] += square.sum()
                for v, fisher in covering:
                    f = origin_buffer[:size].copy_(fisher[span], non_blocking=True)  # F in float32
                    acc[1 + 2 * v] += torch.mul(square, f, out=product_buffer[:size]).sum()
                    free = f.le_(views[v].threshold)  # 1.0 where F <= threshold, else 0.0
                    acc[2 + 2 * v] += free.mul_(square).sum()
    return sum((acc.cpu() for acc in sums.values()), torch.zeros(1 + 2 * len(views), dtype=torch.float64))


def free_threshold(fisher: Sequence[torch.Tensor], free_fraction: float) -> float:
    """The k-th smallest Fisher value, k = max(1, ceil(free_fraction * n)): coordinates at or below it are 'free'.

    With ties at the threshold slightly more than `free_fraction` of the coordinates count as free. Selected
    exactly by streaming over the tensors one at a time (`order_statistics`), never concatenating them.
    """
    return order_statistics(fisher, lambda n: [rank_of_fraction(free_fraction, n)]).values[0]
