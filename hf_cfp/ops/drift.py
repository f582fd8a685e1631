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

from . import fused
from .chunks import gather, packs, workspace
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
    dtype: the tensors with the same covering views are laid out in packs of at most `chunk` elements (default
    `chunk_elements(device)`; `packs`) and gathered into float32 buffers on the parameters' device
    (`workspace`), so the temporaries are three chunks, never the model, and the operations are a few per pack,
    not per tensor. The sums accumulate in float64.
    """
    if any(len(view.fishers) != len(params) for view in views):
        raise ValueError(f"drift_squares: every view needs one F (or None) per tensor, {len(params)} tensors.")
    keys: list[tuple[bool, tuple[int, ...] | None]] = [  # (has theta0, covering views); None once fused
        (start is not None, tuple(v for v, view in enumerate(views) if view.fishers[i] is not None))
        for i, start in enumerate(theta0)
    ]
    sums: dict[torch.device, torch.Tensor] = {}
    with torch.no_grad():
        flats = [param.reshape(-1) for param in params]
        starts = [start.reshape(-1) if start is not None else None for start in theta0]
        rows = [[f.reshape(-1) if f is not None else None for f in view.fishers] for view in views]
        for i in fused_drift(flats, starts, rows, keys, views, sums):
            keys[i] = (False, None)  # done
        for pack in packs(flats, keys, chunk):
            if pack.key[1] is None:
                continue
            has_origin, covering = pack.key
            assert covering is not None  # fused tensors were skipped above
            acc = sums.setdefault(
                pack.device, torch.zeros(1 + 2 * len(views), dtype=torch.float64, device=pack.device)
            )
            square_buffer, origin_buffer, product_buffer = workspace(pack.device, 3, pack.length)
            square = gather(square_buffer, pack, flats)
            if has_origin:
                square.sub_(gather(origin_buffer, pack, starts))
            square.square_()
            # each pack's float32 elements summed in float64
            acc[0] += square.sum(dtype=torch.float64)
            for v in covering:
                f = gather(origin_buffer, pack, rows[v])  # F in float32
                acc[1 + 2 * v] += torch.mul(square, f, out=product_buffer[: pack.size]).sum(dtype=torch.float64)
                free = f.le_(views[v].threshold)  # 1.0 where F <= threshold, else 0.0
                acc[2 + 2 * v] += free.mul_(square).sum(dtype=torch.float64)
    return sum((acc.cpu() for acc in sums.values()), torch.zeros(1 + 2 * len(views), dtype=torch.float64))


def free_threshold(fisher: Sequence[torch.Tensor], free_fraction: float) -> float:
    """The k-th smallest Fisher value, k = max(1, ceil(free_fraction * n)): coordinates at or below it are 'free'.

    With ties at the threshold slightly more than `free_fraction` of the coordinates count as free. Selected
    exactly by streaming over the tensors one at a time (`order_statistics`), never concatenating them.
    """
    return order_statistics(fisher, lambda n: [rank_of_fraction(free_fraction, n)]).values[0]


def fused_drift(flats, starts, rows, keys, views: Sequence[DriftView], sums: dict[torch.device, torch.Tensor]):
    """The indices of the tensors the fused kernels summed into `sums[device]` (float64 [1 + 2V]): theta0 and every
    covering F on the parameter's device, at least `fused.MIN_ELEMENTS` elements ("square" for those no view
    covers, "drift" once per covering view); none further once the kernels cannot run (the pack path does the
    rest)."""
    groups: dict[tuple, list[int]] = {}
    for i, (has_origin, covering) in enumerate(keys):
        device = flats[i].device
        beside = has_origin and starts[i].device == device and all(rows[v][i].device == device for v in covering)
        if beside and flats[i].numel() >= fused.MIN_ELEMENTS:
            groups.setdefault((device, covering), []).append(i)
    done: list[int] = []
    for (device, covering), members in groups.items():
        found = _group_sums(flats, starts, rows, views, members, covering)
        if found is None:
            return done
        sums.setdefault(device, torch.zeros(1 + 2 * len(views), dtype=torch.float64, device=device)).add_(found)
        done += members
    return done


def _group_sums(flats, starts, rows, views, members, covering) -> torch.Tensor | None:
    """float64 [1 + 2V] of some tensors with the same covering views, by the fused kernels (None when they cannot
    run)."""
    params, theta0 = [flats[i] for i in members], [starts[i] for i in members]
    found = torch.zeros(1 + 2 * len(views), dtype=torch.float64, device=params[0].device)
    if not covering:
        total = fused.run("square", [params, theta0])
        if total is False:
            return None
        found[0] = total.double().sum()
    for n, v in enumerate(covering):
        part = fused.run("drift", [params, theta0, [rows[v][i] for i in members]], views[v].threshold)
        if part is False:
            return None
        part = part.double().sum(0)
        found[2 * v + 1 : 2 * v + 3] += part[1:]
        if n == 0:
            found[0] = part[0]
    return found
