"""CFP state for one model: theta0 snapshot, per-step correction, drift metrics (no Trainer needed).

Each process keeps theta0 and F for what it holds (full parameters under DDP, its pieces under
FSDP2, FSDP1 and ZeRO-3), corrects that alone, and adds its shards' sums of squares to the other processes' ones.
"""

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Protocol

import torch

from ..anchor import FisherAnchor
from ..ops import PullWeights, apply_correction, free_drift_sq, free_threshold, sensitive_drift_sq, total_drift_sq
from ..parallel import all_reduce_sum_, local_tensor
from ..parallel.deepspeed import master_correction
from .binding import HeldRange, bind_anchor


class Theta0Reader(Protocol):
    """Where a saved theta0 comes from (`checkpoint.SavedTheta0`)."""

    def read(self, wanted: list[tuple[str, HeldRange]]) -> dict[str, torch.Tensor]:
        """name -> the saved theta0 elements [start, stop) of each wanted parameter, flat."""
        ...


class _CorrectionGroup:
    """Protected parameters of one (device, dtype), with their local theta0, and the pull w cached per lam."""

    def __init__(self, params: list[torch.Tensor], theta0: list[torch.Tensor], fisher: list[torch.Tensor]):
        self.params = params
        self.theta0 = theta0
        self.weights = PullWeights(fisher)

    def correct(self, lam: float) -> None:
        apply_correction([local_tensor(p) for p in self.params], self.theta0, self.weights.at(lam))


class CFPState:
    """Binds a protecting anchor and monitor anchors to `model` and snapshots theta0.

    theta0 (float32) is kept for every trainable parameter covered by any anchor, so
    `cfp/total_drift` = ||theta - theta0|| runs over that union. Only `anchor` is corrected.
    theta0 and F are this process's part of each parameter (the local shard of a DTensor); the
    free-drift threshold comes from the anchor's full F, so it is the same on every process.
    `theta0` (a `Theta0Reader`, such as `checkpoint.SavedTheta0`) restores a saved theta0 instead of
    snapshotting the current weights: resuming from a checkpoint, with any number of processes.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        anchor: FisherAnchor,
        monitors: Sequence[FisherAnchor] = (),
        free_fraction: float = 0.99,
        optimizer: torch.optim.Optimizer | None = None,
        theta0: "Theta0Reader | None" = None,
    ):
        self.model = model
        bound = {a.name: bind_anchor(a, model) for a in (anchor, *monitors)}
        full_fisher = {a.name: a.fisher for a in (anchor, *monitors)}
        self.params: list[torch.Tensor] = []
        self.names: list[str] = []
        self.sharded: list[bool] = []
        self.held: list[HeldRange] = []
        index: dict[int, int] = {}
        for tensors in bound.values():
            for t in tensors:
                if id(t.param) not in index:
                    index[id(t.param)] = len(self.params)
                    self.params.append(t.param)
                    self.names.append(t.name)
                    self.sharded.append(t.sharded)
                    self.held.append(t.held)
        self.theta0 = [local_tensor(p).detach().float().clone() for p in self.params]
        if theta0 is not None:
            saved = theta0.read(list(zip(self.names, self.held, strict=True)))
            for name, local in zip(self.names, self.theta0, strict=True):
                local.copy_(saved[name].reshape(local.shape))
        # anchor name -> (indices into params, local F, free-drift threshold from the anchor's full F)
        self.views = {
            name: (
                [index[id(t.param)] for t in tensors],
                [t.fisher for t in tensors],
                free_threshold([full_fisher[name][t.name] for t in tensors], free_fraction) if tensors else math.inf,
            )
            for name, tensors in bound.items()
        }
        groups: defaultdict[tuple, tuple[list, list, list]] = defaultdict(lambda: ([], [], []))
        for t in bound[anchor.name]:
            group_params, group_theta0, group_fisher = groups[(t.param.device, t.param.dtype)]
            group_params.append(t.param)
            group_theta0.append(self.theta0[index[id(t.param)]])
            group_fisher.append(t.fisher)
        self.groups = [_CorrectionGroup(*g) for g in groups.values()]
        # DeepSpeed ZeRO: also correct the optimizer's fp32 master partitions (None otherwise).
        protected = bound[anchor.name]
        self.master = master_correction(
            model,
            optimizer,
            [t.param for t in protected],
            [self.theta0[index[id(t.param)]] for t in protected],
            [t.fisher for t in protected],
        )

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
        squares: defaultdict[str, list[float]] = defaultdict(list)  # metric -> [S replicated, S of local shards]
        for sharded in (False, True):
            for name, (indices, fisher, threshold) in self.views.items():
                part = [(deltas[i], f) for i, f in zip(indices, fisher, strict=True) if self.sharded[i] == sharded]
                mine, mine_fisher = [d for d, _ in part], [f for _, f in part]
                squares[f"cfp/{name}/sensitive_drift"].append(sensitive_drift_sq(mine, mine_fisher))
                squares[f"cfp/{name}/free_drift"].append(free_drift_sq(mine, mine_fisher, threshold))
            squares["cfp/total_drift"].append(
                total_drift_sq([d for d, s in zip(deltas, self.sharded, strict=True) if s == sharded])
            )
        shard_sums = torch.tensor([s for _, s in squares.values()], dtype=torch.float64)
        if any(self.sharded):
            shard_sums = shard_sums.to(self.theta0[self.sharded.index(True)].device)
            all_reduce_sum_([shard_sums])
        return {
            key: math.sqrt(replicated + float(shards))
            for (key, (replicated, _)), shards in zip(squares.items(), shard_sums, strict=True)
        }
