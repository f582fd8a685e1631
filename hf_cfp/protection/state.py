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
from .adapter_correction import AdapterCorrection
from .binding import HeldRange, bind_anchor
from .peft_adapters import AdaptedWeight, adapted_drift_sq, peft_view


class Theta0Reader(Protocol):
    """Where a saved theta0 comes from (`checkpoint.SavedTheta0`)."""

    def read(self, wanted: list[tuple[str, HeldRange]]) -> dict[str, torch.Tensor]:
        """name -> the saved theta0 elements [start, stop) of each wanted parameter, flat."""
        ...

    def restore_lora(self, adapted: list[AdaptedWeight]) -> None:
        """Set each LoRA-adapted weight's snapshot (its factors at train begin) to the saved one."""
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
    snapshotting the current weights: resuming from a checkpoint, with any number of processes (and, on a
    PeftModel, the LoRA factors at train begin).

    On a `peft.PeftModel` the anchors are keyed by the base model's names (`peft_adapters`): trained base
    parameters (`modules_to_save` copies, trained biases) bind as above, and a LoRA-adapted base weight is
    measured by its merged displacement Delta_W = s B A - s0 B0 A0 (`adapted`) and corrected through its LoRA
    factors by `lora_rule` (`ops.lora_correction`: "proximal_b", "least_squares_b" or "factor_space").
    """

    def __init__(
        self,
        model: torch.nn.Module,
        anchor: FisherAnchor,
        monitors: Sequence[FisherAnchor] = (),
        free_fraction: float = 0.99,
        optimizer: torch.optim.Optimizer | None = None,
        theta0: "Theta0Reader | None" = None,
        lora_rule: str = "proximal_b",
    ):
        self.model = model
        self.anchor_name = anchor.name
        view = peft_view(model)
        bound = {a.name: bind_anchor(a, model, view.params if view else None) for a in (anchor, *monitors)}
        self.adapted, adapted_fisher = _bind_adapted(view.adapted if view else {}, (anchor, *monitors))
        if self.adapted and theta0 is not None:
            theta0.restore_lora(self.adapted)  # the origin of the measured path: the factors at train begin
        covered = adapted_fisher[anchor.name]
        self.adapters = AdapterCorrection([self.adapted[i] for i in covered], list(covered.values()), lora_rule)
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
        # anchor name -> (indices into params, local F, free-drift threshold from the anchor's full F over
        # every covered parameter that can move: trainable ones and LoRA-adapted ones)
        thresholds = {
            name: free_threshold(
                [full_fisher[name][t.name] for t in tensors]
                + [full_fisher[name][self.adapted[i].name] for i in adapted_fisher[name]],
                free_fraction,
            )
            if tensors or adapted_fisher[name]
            else math.inf
            for name, tensors in bound.items()
        }
        self.views = {
            name: ([index[id(t.param)] for t in tensors], [t.fisher for t in tensors], thresholds[name])
            for name, tensors in bound.items()
        }
        self.adapted_views = {name: (adapted_fisher[name], thresholds[name]) for name in bound}
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
            followed=_factor_params(self.adapters),
        )

    def correct(self, lam: float, measure_residual: bool = False) -> None:
        """theta <- theta0 + (theta - theta0) / (1 + lam F) on every protected parameter; on LoRA-adapted
        weights the same through their factors (with `measure_residual`, `cfp/<anchor>/adapter_residual` is
        measured and reported by the next `drift_metrics`)."""
        if lam == 0:
            return
        if self.master is not None:  # ZeRO-1/2: the corrected LoRA factors are carried into the fp32 master copy
            self.master.carry(lambda: self.adapters.correct(lam, measure_residual))
        else:
            self.adapters.correct(lam, measure_residual)
        for group in self.groups:
            group.correct(lam)
        if self.master is not None:
            self.master.correct(lam)

    def drift_metrics(self) -> dict[str, float]:
        """`cfp/<anchor>/sensitive_drift`, `cfp/<anchor>/free_drift` per anchor and `cfp/total_drift`.

        Each is sqrt(S_replicated + sum over processes of S_shard): sums of squares S over the
        local tensors, where only sharded ones are all-reduced (a replicated tensor counts once).
        Every process returns the same, global values; with sharded parameters every process must
        call this (one collective). Builds no autograd graph: every input is detached.
        """
        current = [local_tensor(p).detach().float() for p in self.params]
        deltas = torch._foreach_sub(current, self.theta0) if current else []  # none: a LoRA run's adapters only
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
        if self.adapted:  # LoRA-adapted weights (not sharded): replicated sums
            for key, value in adapted_drift_sq(self.adapted, self.adapted_views).items():
                squares[key][0] += value
        shard_sums = torch.tensor([s for _, s in squares.values()], dtype=torch.float64)
        if any(self.sharded):
            shard_sums = shard_sums.to(self.theta0[self.sharded.index(True)].device)
            all_reduce_sum_([shard_sums])
        metrics = {
            key: math.sqrt(replicated + float(shards))
            for (key, (replicated, _)), shards in zip(squares.items(), shard_sums, strict=True)
        }
        if self.adapters.residual is not None:
            metrics[f"cfp/{self.anchor_name}/adapter_residual"] = self.adapters.residual
        return metrics


def _factor_params(adapters: AdapterCorrection) -> list[torch.Tensor]:
    """The LoRA factors (A and B of each active adapter) of the weights the adapter correction rewrites."""
    return [
        factors[a].weight  # type: ignore[misc]
        for weight, _ in adapters.weights
        for a in weight.adapters
        for factors in (weight.layer.lora_A, weight.layer.lora_B)
    ]


def _bind_adapted(
    adapted: dict[str, AdaptedWeight], anchors: Sequence[FisherAnchor]
) -> tuple[list[AdaptedWeight], dict[str, dict[int, torch.Tensor]]]:
    """The LoRA-adapted weights any anchor covers, each once, and anchor name -> {index into them: F}."""
    covered: list[AdaptedWeight] = []
    fisher: dict[str, dict[int, torch.Tensor]] = {}
    for anchor in anchors:
        fisher[anchor.name] = {}
        for name, weight in adapted.items():
            if name in anchor.fisher:
                if weight not in covered:
                    covered.append(weight)
                device = weight.snapshot[0][1].device
                fisher[anchor.name][covered.index(weight)] = anchor.fisher[name].to(device, torch.float32)
    return covered, fisher
