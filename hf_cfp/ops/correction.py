"""The CFP correction: a proximal pull of the whole path back toward theta0.

After the optimizer proposes theta' = theta_t + d_t, every protected coordinate i becomes

    theta_{t+1,i} = theta0_i + (theta'_i - theta0_i) / (1 + P_i),     P_i = sum_k lam_k F_{k,i}

the proximal step of the summed penalties sum_k (lam_k / 2) sum_i F_{k,i} (theta_i - theta0_i)^2 (one anchor:
P = lam F). A coordinate with P_i = 0 keeps the optimizer's proposal exactly; under a persistent step d the
displacement converges to d / P instead of growing linearly.
Pure tensor math, no transformers import.
"""

from collections.abc import Sequence

import torch

from . import fused
from .chunks import Pack, flat, gather, packs, scatter, workspace

# Per protected tensor, the F of each protecting anchor on it (None where that anchor does not cover it).
AnchorFishers = Sequence[Sequence[torch.Tensor | None]]


def pull_strength(fishers: Sequence[torch.Tensor | None], lams: Sequence[float]) -> torch.Tensor | None:
    """P = sum_k lam_k F_k in float32 (also for a bf16 F) over the anchors covering one tensor (None when none
    does)."""
    strength = None
    for fisher, lam in zip(fishers, lams, strict=True):
        if fisher is not None:
            if strength is None:  # a bf16 F is widened first: multiplied in bf16 it would be rounded
                strength = fisher.float().mul(float(lam)) if fisher.dtype != torch.float32 else fisher.mul(float(lam))
            else:
                strength.add_(fisher, alpha=float(lam))
    return strength


def pack_strength(
    pack: Pack[tuple[int, ...]],
    rows: Sequence[Sequence[torch.Tensor | None]],
    lams: Sequence[float],
    out: torch.Tensor,
    scratch: torch.Tensor,
) -> torch.Tensor:
    """P = sum_k lam_k F_k in float32 over a pack's elements, k over `pack.key` (the anchors covering every
    tensor in it; `rows[i][k]`: anchor k's flat F on tensor i): F_k gathered into `out` (the first) or `scratch`
    (the others, then added), widened before it is weighted. Returns out[:pack.size]."""
    first, *others = pack.key
    strength = gather(out, pack, [row[first] for row in rows]).mul_(float(lams[first]))
    for k in others:
        strength.add_(gather(scratch, pack, [row[k] for row in rows]), alpha=float(lams[k]))
    return strength


class PullStrengths(Sequence[torch.Tensor]):
    """P = sum_k lam_k F_k of each tensor (`fishers[i]`: a row as in `proximal_pull_`), computed when read, so a
    streaming pass over them (`order_statistics`) never holds them all."""

    def __init__(self, fishers: AnchorFishers, lams: Sequence[float]):
        self.fishers, self.lams = fishers, lams

    def __len__(self) -> int:
        return len(self.fishers)

    def __getitem__(self, i):  # an integer index
        strength = pull_strength(self.fishers[i], self.lams)
        if strength is None:
            raise ValueError(f"PullStrengths: no anchor covers tensor {i}.")
        return strength


def proximal_pull_(
    params: Sequence[torch.Tensor],
    theta0: Sequence[torch.Tensor],
    fishers: AnchorFishers,
    lams: Sequence[float],
    chunk: int | None = None,
) -> None:
    """In place, on every tensor: params <- theta0 + (params - theta0) / (1 + P), P = sum_k lam_k F_k
    (`fishers[i][k]`: anchor k's F on `params[i]`, or None; a tensor no anchor covers is left as it is).

    A tensor covered by one anchor, with theta0 and F beside it, is pulled by one fused kernel (`fused`: read once,
    written once, no temporary) where the kernels can run. Every other tensor, and all of them otherwise, in any
    floating dtypes (F and theta0 need not match the parameter's): the tensors covered by the same anchors
    are laid out in packs of at most `chunk` elements (default `chunk_elements(device)`; `packs`), each gathered
    into three float32 buffers (`workspace`), computed there and written back once, so the temporaries are three
    chunks, never the model, and the operations are a few per pack, not per tensor. `params` must be contiguous
    (written through a flat view); theta0 and F may live on another device (offloaded) in any floating dtype.
    """
    covering = [tuple(k for k, fisher in enumerate(row) if fisher is not None) for row in fishers]
    with torch.no_grad():
        flats = [flat(param) for param in params]
        starts = [start.reshape(-1) for start in theta0]
        rows = [[f.reshape(-1) if f is not None else None for f in row] for row in fishers]
        for i in fused_pulls(flats, starts, rows, covering, lams):
            covering[i] = ()  # done
        for pack in packs(flats, covering, chunk):
            if not pack.key:
                continue
            relief_buffer, delta_buffer, origin_buffer = workspace(pack.device, 3, pack.length)
            relief = pack_strength(pack, rows, lams, relief_buffer, delta_buffer).add_(1.0)  # 1 + P
            origin = gather(origin_buffer, pack, starts)  # theta0 in float32
            delta = gather(delta_buffer, pack, flats).sub_(origin)
            scatter(flats, pack, origin.addcdiv_(delta, relief))  # rounded once to each parameter's dtype


def fused_pulls(flats, starts, rows, covering, lams: Sequence[float]) -> list[int]:
    """The tensors pulled by the fused kernel ("pull", in place): those `fused_runs` reaches."""
    return [i for _, _, members, _ in fused_runs("pull", flats, starts, rows, covering, lams) for i in members]


def fused_runs(kernel: str, flats, starts, rows, covering, lams: Sequence[float]):
    """Yield (device, anchor k, the tensors' indices, the kernel's result) for each group of tensors a fused kernel
    takes (one covering anchor k, theta0 and F on the parameter's device, at least `fused.MIN_ELEMENTS` elements),
    `kernel` run on them with lam_k; stop at the first group the kernels cannot run (the pack path does the rest)."""
    groups: dict[tuple[torch.device, int], list[int]] = {}
    for i, key in enumerate(covering):
        if len(key) != 1:
            continue
        device = flats[i].device
        if starts[i].device == device and rows[i][key[0]].device == device and flats[i].numel() >= fused.MIN_ELEMENTS:
            groups.setdefault((device, key[0]), []).append(i)
    for (device, k), members in groups.items():
        columns = [[flats[i] for i in members], [starts[i] for i in members], [rows[i][k] for i in members]]
        result = fused.run(kernel, columns, lams[k])
        if result is False:
            return
        yield device, k, members, result
