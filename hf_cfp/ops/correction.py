"""The CFP correction: a proximal pull of the whole path back toward theta0.

After the optimizer proposes theta' = theta_t + d_t, every protected coordinate i becomes

    theta_{t+1,i} = theta0_i + (theta'_i - theta0_i) / (1 + P_i),     P_i = sum_k lam_k F_{k,i}
                  = lerp(theta'_i, theta0_i, w_i),                    w_i = P_i / (1 + P_i),

the proximal step of the summed penalties sum_k (lam_k / 2) sum_i F_{k,i} (theta_i - theta0_i)^2 (one anchor:
P = lam F). A coordinate with P_i = 0 keeps the optimizer's proposal exactly; under a persistent step d the
displacement converges to d / P instead of growing linearly.
Pure tensor math (multi-tensor `torch._foreach_*` ops), no transformers import.
"""

from collections.abc import Sequence

import torch

# Per protected tensor, the F of each protecting anchor on it (None where that anchor does not cover it).
AnchorFishers = Sequence[Sequence[torch.Tensor | None]]


def pull_strength(fishers: Sequence[torch.Tensor | None], lams: Sequence[float]) -> torch.Tensor | None:
    """P = sum_k lam_k F_k over the anchors covering one tensor (None when none covers it)."""
    strength = None
    for fisher, lam in zip(fishers, lams, strict=True):
        if fisher is not None:
            strength = fisher * float(lam) if strength is None else strength.add_(fisher, alpha=float(lam))
    return strength


class PullWeights:
    """The pull w = P / (1 + P), P = sum_k lam_k F_k, for a fixed list of tensors, recomputed only when the
    lams change: a constant lam costs one computation for the whole run; a schedule one per new value.

    `fishers[i][k]` is anchor k's F on tensor i (float32), None where anchor k does not cover tensor i."""

    def __init__(self, fishers: AnchorFishers):
        self.fishers = [list(f) for f in fishers]
        if any(all(f is None for f in row) for row in self.fishers):
            raise ValueError("PullWeights: every tensor must be covered by at least one anchor's F.")
        self._lams: tuple[float, ...] | None = None
        self._weights: list[torch.Tensor] = []

    def at(self, lams: Sequence[float]) -> list[torch.Tensor]:
        """w for these lams, one per anchor (cached from the previous call when they are unchanged)."""
        if tuple(lams) != self._lams:
            strengths = [pull_strength(f, lams) for f in self.fishers]
            self._weights = [p / (p + 1.0) for p in strengths if p is not None]
            self._lams = tuple(lams)
        return self._weights


def apply_correction(
    params: Sequence[torch.Tensor], theta0: Sequence[torch.Tensor], weights: Sequence[torch.Tensor]
) -> None:
    """In place: params <- lerp(params, theta0, w) = theta0 + (params - theta0) * (1 - w).

    `params` share one dtype; `theta0` and `weights` are float32. Low-precision parameters
    (bf16, fp16) are computed in float32 and written back once.
    """
    # `with`, not `@torch.no_grad()`: mutmut skips decorated functions (scripts/mutation_report.sh).
    with torch.no_grad():
        if not params:
            return
        if params[0].dtype == torch.float32:
            torch._foreach_lerp_(list(params), list(theta0), list(weights))
            return
        work = [p.float() for p in params]
        torch._foreach_lerp_(work, list(theta0), list(weights))
        torch._foreach_copy_(list(params), work)
