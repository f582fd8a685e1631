"""CFP state for one model: theta0 snapshot, per-step correction, drift metrics (no Trainer needed).

Each process keeps theta0 and F for what it holds (full parameters under DDP, local shards under
FSDP2), corrects that alone, and adds its shards' sums of squares to the other processes' ones.
"""

import math
from collections import defaultdict

import torch

from . import drift, zero
from .binding import bind_anchor, local_tensor
from .correction import apply_correction, lerp_weights
from .distributed import all_reduce_sum_
from .errors import CFPError


class _CorrectionGroup:
    """Protected parameters of one (device, dtype), with local theta0 and F, and w cached per lam."""

    def __init__(self, params, theta0, fisher):
        self.params, self.theta0, self.fisher = params, theta0, fisher
        self._lam, self._weights = None, None

    def theta0_state(self) -> dict[str, torch.Tensor]:
        """name -> this process's theta0 (float32, CPU), to save with a checkpoint."""
        return {name: t.cpu() for name, t in zip(self.names, self.theta0)}

    def correct(self, lam: float) -> None:
        if lam != self._lam:
            self._lam, self._weights = lam, lerp_weights(self.fisher, lam)
        apply_correction([local_tensor(p) for p in self.params], self.theta0, self._weights)


class CFPState:
    """Binds a protecting anchor and monitor anchors to `model` and snapshots theta0.

    theta0 (float32) is kept for every trainable parameter covered by any anchor, so
    `cfp/total_drift` = ||theta - theta0|| runs over that union. Only `anchor` is corrected.
    theta0 and F are this process's part of each parameter (the local shard of a DTensor); the
    free-drift threshold comes from the anchor's full F, so it is the same on every process.
    `theta0` (name -> this process's tensor, as `theta0_state()` gives) restores a saved theta0
    instead of snapshotting the current weights: resuming from a checkpoint.
    """

    def __init__(self, model: torch.nn.Module, anchor, monitors=(), free_fraction: float = 0.99, optimizer=None,
                 theta0: dict[str, torch.Tensor] | None = None):
        self.model = model
        bound = {a.name: bind_anchor(a, model) for a in (anchor, *monitors)}
        full_fisher = {a.name: a.fisher for a in (anchor, *monitors)}
        self.params, self.names, self.sharded, index = [], [], [], {}
        for tensors in bound.values():
            for t in tensors:
                if id(t.param) not in index:
                    index[id(t.param)] = len(self.params)
                    self.params.append(t.param)
                    self.names.append(t.name)
                    self.sharded.append(t.sharded)
        self.theta0 = [local_tensor(p).detach().float().clone() for p in self.params] if theta0 is None else \
            [_restored(theta0, name, local_tensor(p)) for name, p in zip(self.names, self.params)]
        self.views = {
            name: ([index[id(t.param)] for t in tensors], [t.fisher for t in tensors],
                   drift.free_threshold([full_fisher[name][t.name] for t in tensors], free_fraction)
                   if tensors else math.inf)
            for name, tensors in bound.items()
        }
        groups = defaultdict(lambda: ([], [], []))
        for t in bound[anchor.name]:
            params, theta0, fisher = groups[(t.param.device, t.param.dtype)]
            params.append(t.param)
            theta0.append(self.theta0[index[id(t.param)]])
            fisher.append(t.fisher)
        self.groups = [_CorrectionGroup(*g) for g in groups.values()]
        # DeepSpeed ZeRO: also correct the optimizer's fp32 master partitions (None otherwise).
        protected = bound[anchor.name]
        self.master = zero.master_correction(model, optimizer, [t.param for t in protected],
                                             [self.theta0[index[id(t.param)]] for t in protected],
                                             [t.fisher for t in protected])

    def theta0_state(self) -> dict[str, torch.Tensor]:
        """name -> this process's theta0 (float32, CPU), to save with a checkpoint."""
        return {name: t.cpu() for name, t in zip(self.names, self.theta0)}

    def correct(self, lam: float) -> None:
        """theta <- theta0 + (theta - theta0) / (1 + lam F) on every protected parameter."""
        if lam == 0:
            return
        for group in self.groups:
            group.correct(lam)
        if self.master is not None:
            self.master.correct(lam)

    @torch.no_grad()
    def drift_metrics(self) -> dict[str, float]:
        """`cfp/<anchor>/sensitive_drift`, `cfp/<anchor>/free_drift` per anchor and `cfp/total_drift`.

        Each is sqrt(S_replicated + sum over processes of S_shard): sums of squares S over the
        local tensors, where only sharded ones are all-reduced (a replicated tensor counts once).
        Every process returns the same, global values; with sharded parameters every process must
        call this (one collective).
        """
        deltas = torch._foreach_sub([local_tensor(p).detach().float() for p in self.params], self.theta0)
        squares = defaultdict(list)  # metric -> [S over replicated tensors, S over this process's shards]
        for sharded in (False, True):
            for name, (indices, fisher, threshold) in self.views.items():
                part = [(deltas[i], f) for i, f in zip(indices, fisher) if self.sharded[i] == sharded]
                mine, mine_fisher = [d for d, _ in part], [f for _, f in part]
                squares[f"cfp/{name}/sensitive_drift"].append(drift.sensitive_drift_sq(mine, mine_fisher))
                squares[f"cfp/{name}/free_drift"].append(drift.free_drift_sq(mine, mine_fisher, threshold))
            squares["cfp/total_drift"].append(
                drift.total_drift_sq([d for d, s in zip(deltas, self.sharded) if s == sharded]))
        shard_sums = torch.tensor([s for _, s in squares.values()], dtype=torch.float64)
        if any(self.sharded):
            shard_sums = shard_sums.to(self.theta0[self.sharded.index(True)].device)
            all_reduce_sum_([shard_sums])
        return {key: math.sqrt(replicated + float(shards))
                for (key, (replicated, _)), shards in zip(squares.items(), shard_sums)}


def _restored(theta0: dict[str, torch.Tensor], name: str, local: torch.Tensor) -> torch.Tensor:
    saved = theta0.get(name)
    if saved is None or saved.shape != local.shape:
        raise CFPError(f"The saved theta0 has {'no' if saved is None else 'another shape for'} parameter {name!r}: "
                       "resume with the same model, anchors and number of processes as the original run.")
    return saved.to(device=local.device, dtype=torch.float32)
