"""CFP state for one model: theta0 snapshot, per-step correction, drift metrics (no Trainer needed)."""

import math
from collections import defaultdict

import torch

from . import drift
from .binding import bind_anchor
from .correction import apply_correction, lerp_weights


class _CorrectionGroup:
    """Protected parameters of one (device, dtype), with theta0 and F, and w cached per lam."""

    def __init__(self, params, theta0, fisher):
        self.params, self.theta0, self.fisher = params, theta0, fisher
        self._lam, self._weights = None, None

    def correct(self, lam: float) -> None:
        if lam != self._lam:
            self._lam, self._weights = lam, lerp_weights(self.fisher, lam)
        apply_correction(self.params, self.theta0, self._weights)


class CFPState:
    """Binds a protecting anchor and monitor anchors to `model` and snapshots theta0.

    theta0 (float32) is kept for every trainable parameter covered by any anchor, so
    `cfp/total_drift` = ||theta - theta0|| runs over that union. Only `anchor` is corrected.
    """

    def __init__(self, model: torch.nn.Module, anchor, monitors=(), free_fraction: float = 0.99):
        self.model = model
        bound = {a.name: bind_anchor(a, model) for a in (anchor, *monitors)}
        self.params, index = [], {}
        for tensors in bound.values():
            for t in tensors:
                if id(t.param) not in index:
                    index[id(t.param)] = len(self.params)
                    self.params.append(t.param)
        self.theta0 = [p.detach().float().clone() for p in self.params]
        self.views = {
            name: ([index[id(t.param)] for t in tensors], [t.fisher for t in tensors],
                   drift.free_threshold([t.fisher for t in tensors], free_fraction) if tensors else math.inf)
            for name, tensors in bound.items()
        }
        groups = defaultdict(lambda: ([], [], []))
        for t in bound[anchor.name]:
            params, theta0, fisher = groups[(t.param.device, t.param.dtype)]
            params.append(t.param)
            theta0.append(self.theta0[index[id(t.param)]])
            fisher.append(t.fisher)
        self.groups = [_CorrectionGroup(*g) for g in groups.values()]

    def correct(self, lam: float) -> None:
        """theta <- theta0 + (theta - theta0) / (1 + lam F) on every protected parameter."""
        if lam == 0:
            return
        for group in self.groups:
            group.correct(lam)

    @torch.no_grad()
    def drift_metrics(self) -> dict[str, float]:
        """`cfp/<anchor>/sensitive_drift`, `cfp/<anchor>/free_drift` per anchor and `cfp/total_drift`."""
        deltas = torch._foreach_sub([p.detach().float() for p in self.params], self.theta0)
        metrics = {}
        for name, (indices, fisher, threshold) in self.views.items():
            mine = [deltas[i] for i in indices]
            metrics[f"cfp/{name}/sensitive_drift"] = math.sqrt(drift.sensitive_drift_sq(mine, fisher))
            metrics[f"cfp/{name}/free_drift"] = math.sqrt(drift.free_drift_sq(mine, fisher, threshold))
        metrics["cfp/total_drift"] = math.sqrt(drift.total_drift_sq(deltas))
        return metrics
