"""CFP state for one model: theta0 snapshot, per-step correction, drift metrics (no Trainer needed).

Each process keeps theta0 and F for what it holds (full parameters under DDP, its pieces under
FSDP2, FSDP1 and ZeRO-3), corrects that alone, and adds its shards' sums of squares to the other processes' ones.
"""

import math
from collections import defaultdict
from collections.abc import Sequence

import torch

from ..anchor import FisherAnchor
from ..errors import CFPError
from ..ops import PullWeights, apply_correction, free_drift_sq, free_threshold, sensitive_drift_sq, total_drift_sq
from ..parallel import all_reduce_sum_, local_tensor
from ..parallel.deepspeed import master_correction
from .binding import bind_anchor


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
    `theta0` (name -> this process's tensor, as `theta0_state()` gives) restores a saved theta0
    instead of snapshotting the current weights: resuming from a checkpoint.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        anchor: FisherAnchor,
        monitors: Sequence[FisherAnchor] = (),
        free_fraction: float = 0.99,
        optimizer: torch.optim.Optimizer | None = None,
        theta0: dict[str, torch.Tensor] | None = None,
    ):
        self.model = model
        bound = {a.name: bind_anchor(a, model) for a in (anchor, *monitors)}
        full_fisher = {a.name: a.fisher for a in (anchor, *monitors)}
        self.params: list[torch.Tensor] = []
        self.names: list[str] = []
        self.sharded: list[bool] = []
        index: dict[int, int] = {}
        for tensors in bound.values():
            for t in tensors:
                if id(t.param) not in index:
                    index[id(t.param)] = len(self.params)
                    self.params.append(t.param)
                    self.names.append(t.name)
                    self.sharded.append(t.sharded)
        if theta0 is None:
            self.theta0 = [local_tensor(p).detach().float().clone() for p in self.params]
        else:
            self.theta0 = [
                _restored(theta0, name, local_tensor(p)) for name, p in zip(self.names, self.params, strict=True)
            ]
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

    def theta0_state(self) -> dict[str, torch.Tensor]:
        """name -> this process's theta0 (float32, CPU), to save with a checkpoint."""
        return {name: t.cpu() for name, t in zip(self.names, self.theta0, strict=True)}

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


def _restored(theta0: dict[str, torch.Tensor], name: str, local: torch.Tensor) -> torch.Tensor:
    saved = theta0.get(name)
    if saved is None or saved.shape != local.shape:
        raise CFPError(
            f"The saved theta0 has {'no' if saved is None else 'another shape for'} parameter {name!r}: "
            "resume with the same model, anchors and number of processes as the original run."
        )
    return saved.to(device=local.device, dtype=torch.float32)
