"""The CFP correction: a proximal pull of the whole path back toward theta0.

After the optimizer proposes theta' = theta_t + d_t, every protected coordinate i becomes

    theta_{t+1,i} = theta0_i + (theta'_i - theta0_i) / (1 + P_i),     P_i = sum_k lam_k F_{k,i}
                  = lerp(theta'_i, theta0_i, w_i),                    w_i = P_i / (1 + P_i),

the proximal step of the summed penalties sum_k (lam_k / 2) sum_i F_{k,i} (theta_i - theta0_i)^2 (one anchor:
P = lam F). A coordinate with P_i = 0 keeps the optimizer's proposal exactly; under a persistent step d the
displacement converges to d / P instead of growing linearly.
Pure tensor math, no transformers import.
"""

from collections.abc import Sequence

import torch

from .chunks import CHUNK_ELEMENTS, flat, spans

# Per protected tensor, the F of each protecting anchor on it (None where that anchor does not cover it).
AnchorFishers = Sequence[Sequence[torch.Tensor | None]]


def pull_strength(fishers: Sequence[torch.Tensor | None], lams: Sequence[float]) -> torch.Tensor | None:
    """P = sum_k lam_k F_k (float32, a new tensor) over the anchors covering one tensor (None when none does)."""
    strength = None
    for fisher, lam in zip(fishers, lams, strict=True):
        if fisher is not None:
            if strength is None:
                strength = fisher.float() * float(lam)  # in float32 for a bf16 F too
            else:
                strength.add_(fisher, alpha=float(lam))
    return strength


def proximal_pull_(
    params: Sequence[torch.Tensor],
    theta0: Sequence[torch.Tensor],
    fishers: AnchorFishers,
    lams: Sequence[float],
    chunk: int = CHUNK_ELEMENTS,
) -> None:
    """In place, on every tensor: params <- lerp(params, theta0, w) = theta0 + (params - theta0) / (1 + P), with
    w = P / (1 + P) and P = sum_k lam_k F_k (`fishers[i][k]`: anchor k's F on `params[i]`, or None).

    Any floating dtypes (F and theta0 need not match the parameter's): each span of at most `chunk` elements is
    computed in float32 and written back once, so the temporaries are a few chunks, never the model. `params`
    must be contiguous (written through a flat view); theta0 and F must be on the parameter's device.
    """
    with torch.no_grad():
        for param, start, row in zip(params, theta0, fishers, strict=True):
            param_flat, start_flat = flat(param), start.reshape(-1)
            rows = [f.reshape(-1) if f is not None else None for f in row]
            for span in spans(param_flat.numel(), chunk):
                strength = pull_strength([f[span] if f is not None else None for f in rows], lams)
                if strength is None:
                    continue
                pull = strength.div_(strength + 1.0)  # w = P / (1 + P)
                target, origin = param_flat[span], start_flat[span].float()
                if target.dtype == torch.float32:
                    target.lerp_(origin, pull)
                else:  # computed in float32, rounded once
                    target.copy_(target.float().lerp_(origin, pull))
