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

from .chunks import flat, gather, packs, scatter, workspace

# Per protected tensor, the F of each protecting anchor on it (None where that anchor does not cover it).
AnchorFishers = Sequence[Sequence[torch.Tensor | None]]


def pull_strength(
    fishers: Sequence[torch.Tensor | None], lams: Sequence[float], out: torch.Tensor | None = None
) -> torch.Tensor | None:
    """P = sum_k lam_k F_k in float32 (also for a bf16 F) over the anchors covering one tensor (None when none
    does), in `out` when given (a float32 buffer of the same number of elements), else a new tensor."""
    strength = None
    for fisher, lam in zip(fishers, lams, strict=True):
        if fisher is not None:
            if strength is None and out is not None and fisher.dtype == torch.float32:
                strength = torch.mul(fisher.reshape(out.shape), float(lam), out=out)  # one pass
            elif strength is None:  # a bf16 F is widened first: multiplied in bf16 it would be rounded
                strength = out.copy_(fisher.reshape(out.shape)) if out is not None else fisher.float().clone()
                strength.mul_(float(lam))
            else:
                strength.add_(fisher.reshape(strength.shape), alpha=float(lam))
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

    Any floating dtypes (F and theta0 need not match the parameter's): the tensors covered by the same anchors
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
        for pack in packs(flats, covering, chunk):
            anchors = pack.key
            if not anchors:
                continue
            relief_buffer, delta_buffer, origin_buffer = workspace(pack.device, 3, pack.length)
            first, *others = anchors
            relief = gather(relief_buffer, pack, [row[first] for row in rows]).mul_(float(lams[first]))
            for k in others:  # widened to float32 before it is weighted: a bf16 product would be rounded
                relief.add_(gather(delta_buffer, pack, [row[k] for row in rows]), alpha=float(lams[k]))
            relief.add_(1.0)  # 1 + P
            origin = gather(origin_buffer, pack, starts)  # theta0 in float32
            delta = gather(delta_buffer, pack, flats).sub_(origin)
            scatter(flats, pack, origin.addcdiv_(delta, relief))  # rounded once to each parameter's dtype
