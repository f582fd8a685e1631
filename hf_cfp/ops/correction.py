"""The CFP correction: a proximal pull of the whole path back toward theta0.

After the optimizer proposes theta' = theta_t + d_t, every protected coordinate i becomes

    theta_{t+1,i} = theta0_i + (theta'_i - theta0_i) / (1 + lam_t * F_i)
                  = lerp(theta'_i, theta0_i, w_i),   w_i = lam_t F_i / (1 + lam_t F_i).

A coordinate with F_i = 0 (or lam_t = 0) keeps the optimizer's proposal exactly; under a
persistent step d the displacement converges to d / (lam F) instead of growing linearly.
Pure tensor math (multi-tensor `torch._foreach_*` ops), no transformers import.
"""

from collections.abc import Sequence

import torch


def lerp_weights(fisher: Sequence[torch.Tensor], lam: float) -> list[torch.Tensor]:
    """Per-coordinate pull toward theta0: w = lam F / (1 + lam F), in float32."""
    scaled = torch._foreach_mul(list(fisher), float(lam))
    return list(torch._foreach_div(scaled, torch._foreach_add(scaled, 1.0)))


class PullWeights:
    """The pull w = lam F / (1 + lam F) for a fixed list of F tensors, recomputed only when lam changes.

    A constant lam costs one computation for the whole run; a schedule costs one per new value.
    """

    def __init__(self, fisher: Sequence[torch.Tensor]):
        self.fisher = list(fisher)
        self._lam: float | None = None
        self._weights: list[torch.Tensor] = []

    def at(self, lam: float) -> list[torch.Tensor]:
        """w for this lam (cached from the previous call when lam is unchanged)."""
        if lam != self._lam:
            self._lam, self._weights = lam, lerp_weights(self.fisher, lam)
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
