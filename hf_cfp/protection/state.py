"""CFP state for one model: theta0 snapshot, per-step correction, drift metrics (no Trainer needed).

Each process keeps theta0 and F for what it holds (full parameters under DDP, its pieces under
FSDP2, FSDP1 and ZeRO-3), corrects that alone, and adds its shards' sums of squares to the other processes' ones.
"""

import math
from collections.abc import Iterable, Mapping, Sequence

import torch

from ..anchor import FisherAnchor
from ..anchor.lazy import TensorsOf
from ..errors import CFPArgumentError, plural
from ..names import ADAPTER_RESIDUAL, LAM, PREDICTED_KL, SENSITIVE_DRIFT, drift_keys
from ..ops import DriftView, PullStrengths, budget_terms, drift_squares, free_threshold, proximal_pull_, solve_budget
from ..parallel import all_reduce_sum_, local_tensor
from ..parallel.deepspeed import master_correction
from .adapter_correction import AdapterCorrection
from .binding import BoundTensor, HeldRange, bind_anchor
from .memory import MemoryPlan
from .peft_adapters import AdaptedWeight, adapted_drift_sq, peft_view
from .sparse import SparseCorrection, SparseReport, coordinate_threshold, mass_threshold, sparse_report
from .theta0 import Theta0Reader


class CFPState:
    """Binds protecting anchors and monitor anchors to `model` and snapshots theta0.

    theta0 is kept for every trainable parameter any anchor covers, so `cfp/total_drift` = ||theta - theta0|| runs
    over that union. Only the protecting anchors correct: theta <- theta0 + (theta - theta0) / (1 + sum_k lam_k F_k),
    one pass. theta0 and F are this process's part of each parameter (the local shard of a DTensor); the free-drift
    threshold comes from the anchor's full F, so it is the same on every process.

    On a `peft.PeftModel` the anchors are keyed by the base model's names (`peft_adapters`): trained base parameters
    (`modules_to_save` copies, trained biases) bind as above, and a LoRA-adapted base weight is measured by its
    merged displacement Delta_W = s B A - s0 B0 A0 (`adapted`) and corrected through its LoRA factors (`lora_rule`).

    Args:
        model (`torch.nn.Module`): the model being trained (plain or PEFT; under DDP, FSDP2, FSDP1 or ZeRO).
        anchor ([`FisherAnchor`] or a sequence of them): the protecting anchor(s).
        monitors (sequence of [`FisherAnchor`], *optional*, defaults to `()`): anchors measured, not corrected.
        free_fraction (`float`, *optional*, defaults to `0.99`): the smallest-F share `free_drift` runs over.
        optimizer (`torch.optim.Optimizer`, *optional*): under DeepSpeed ZeRO, its fp32 masters are corrected too.
        theta0 (`Theta0Reader`, *optional*): a saved theta0 (`checkpoint.SavedTheta0`) restored instead of a snapshot
            of the weights: resuming, under any number of processes (on a PeftModel, the LoRA factors at train begin).
        lora_rule (`str`, *optional*, defaults to `"proximal_b"`): "proximal_b", "least_squares_b" or "factor_space"
            (`ops.lora_correction`).
        memory (`MemoryPlan`, *optional*): where and in which dtype theta0 and F are kept (default: dense, F float32).

    Raises:
        CFPArgumentError: no protecting anchor, or a sparse plan under DeepSpeed ZeRO.
        AnchorMismatchError: an anchor covers a parameter the model does not have, or with another shape.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        anchor: FisherAnchor | Sequence[FisherAnchor],
        monitors: Sequence[FisherAnchor] = (),
        free_fraction: float = 0.99,
        optimizer: torch.optim.Optimizer | None = None,
        theta0: Theta0Reader | None = None,
        lora_rule: str = "proximal_b",
        memory: MemoryPlan | None = None,
    ):
        protecting = [anchor] if isinstance(anchor, FisherAnchor) else list(anchor)
        if not protecting:
            raise CFPArgumentError("CFPState needs at least one protecting anchor.")
        self.model = model
        self.memory = memory or MemoryPlan()
        self.protecting = [a.name for a in protecting]
        self.lams = [0.0] * len(protecting)  # of the last correction
        anchors = (*protecting, *monitors)
        view = peft_view(model)
        bound = {
            a.name: bind_anchor(a, model, view.params if view else None, self.memory.store_fisher) for a in anchors
        }
        self.adapted, adapted_fisher = _bind_adapted(view.adapted if view else {}, anchors)
        if self.adapted and theta0 is not None:
            theta0.restore_lora(self.adapted)  # the origin of the measured path: the factors at train begin
        adapted_rows = _rows(range(len(self.adapted)), self.protecting, adapted_fisher)
        self.adapters = AdapterCorrection(
            [self.adapted[i] for i in adapted_rows], list(adapted_rows.values()), lora_rule
        )
        self._gather_params(bound)
        saved = theta0.read(list(zip(self.names, self.held, strict=True))) if theta0 is not None else {}
        self.theta0 = [
            self.memory.snapshot(local_tensor(p), saved.get(n)) for p, n in zip(self.params, self.names, strict=True)
        ]
        full_fisher = {a.name: a.fisher for a in anchors}
        self._measure_views(bound, adapted_fisher, full_fisher, free_fraction)
        fisher_of = {name: {self.index[id(t.param)]: t.fisher for t in tensors} for name, tensors in bound.items()}
        protected = _rows(range(len(self.params)), self.protecting, fisher_of)  # param index -> row of F
        self.protected = list(protected.items())  # (param index, row of F): what is corrected
        self.sparse: SparseCorrection | None = None
        self.sparse_report: SparseReport | None = None
        if self.memory.sparse is not None:
            self._keep_sparse({a.name: bound[a.name] for a in protecting}, full_fisher)
        # DeepSpeed ZeRO: also correct the optimizer's fp32 master partitions (None otherwise).
        self.master = master_correction(
            model,
            optimizer,
            [self.params[i] for i in protected],
            [self.theta0[i] for i in protected],
            list(protected.values()),
            followed=_factor_params(self.adapters),
        )
        if self.master is not None and self.sparse is not None:
            raise CFPArgumentError("sparse is not supported under DeepSpeed ZeRO yet: use a dense memory plan.")

    def _keep_sparse(self, bound: dict[str, list[BoundTensor]], full_fisher: dict[str, Mapping]) -> None:
        """`sparse` and `sparse_report`: each protecting anchor's threshold over its full F on the trainable
        parameters (the same on every process), and the kept coordinates of this process's protected tensors."""
        pick = coordinate_threshold if self.memory.sparse_by == "coordinates" else mass_threshold
        share = float(self.memory.sparse)  # type: ignore[arg-type]
        thresholds = [
            pick(TensorsOf(full_fisher[name], [t.name for t in tensors]), share) for name, tensors in bound.items()
        ]
        full_rows = (  # read one parameter at a time
            [full_fisher[a][self.names[i]] if self.names[i] in full_fisher[a] else None for a in self.protecting]
            for i, _ in self.protected
        )
        self.sparse_report = sparse_report(full_rows, thresholds)
        self.sparse = SparseCorrection(
            [local_tensor(self.params[i]) for i, _ in self.protected],
            [self.theta0[i] for i, _ in self.protected],
            [row for _, row in self.protected],
            thresholds,
        )

    def _gather_params(self, bound: dict[str, list[BoundTensor]]) -> None:
        """Every parameter any anchor covers, once: `params`, `names`, `sharded`, `held`, and `index` (id -> i)."""
        self.params: list[torch.Tensor] = []
        self.names: list[str] = []
        self.sharded: list[bool] = []
        self.held: list[HeldRange] = []
        self.index: dict[int, int] = {}
        for tensors in bound.values():
            for t in tensors:
                if id(t.param) not in self.index:
                    self.index[id(t.param)] = len(self.params)
                    self.params.append(t.param)
                    self.names.append(t.name)
                    self.sharded.append(t.sharded)
                    self.held.append(t.held)

    def _measure_views(
        self,
        bound: dict[str, list[BoundTensor]],
        adapted_fisher: dict[str, dict[int, torch.Tensor]],
        full_fisher: dict[str, Mapping[str, torch.Tensor]],
        free_fraction: float,
    ) -> None:
        """Per anchor, what its metrics sum over: `views` (indices into params, local F, free-drift threshold)
        and `adapted_views` (adapted weights' F, threshold). The threshold comes from the anchor's full F over
        every covered parameter that can move: trainable ones and LoRA-adapted ones, read one tensor at a time
        (an anchor kept in its files is never loaded whole)."""
        thresholds = {
            name: free_threshold(
                TensorsOf(
                    full_fisher[name],
                    [t.name for t in tensors] + [self.adapted[i].name for i in adapted_fisher[name]],
                ),
                free_fraction,
            )
            if tensors or adapted_fisher[name]
            else math.inf
            for name, tensors in bound.items()
        }
        self.views = {
            name: ([self.index[id(t.param)] for t in tensors], [t.fisher for t in tensors], thresholds[name])
            for name, tensors in bound.items()
        }
        self.adapted_views = {name: (adapted_fisher[name], thresholds[name]) for name in bound}

    def correct(self, lam: float | Sequence[float], measure_residual: bool = False) -> None:
        """theta <- theta0 + (theta - theta0) / (1 + sum_k lam_k F_k) on every protected parameter; on LoRA-adapted
        weights the same through their factors.

        Args:
            lam (`float` or sequence of `float`): lam_k >= 0, one per protecting anchor (a number for one anchor).
            measure_residual (`bool`, *optional*, defaults to `False`): measure `cfp/<anchor>/adapter_residual`,
                reported by the next `drift_metrics`.

        Raises:
            CFPArgumentError: not one lam per protecting anchor.
        """
        self.lams = [float(lam)] if isinstance(lam, (int, float)) else [float(v) for v in lam]
        if len(self.lams) != len(self.protecting):
            lams, anchors = plural(len(self.lams), "lam"), plural(len(self.protecting), "protecting anchor")
            raise CFPArgumentError(f"{lams} for {anchors} {self.protecting}: give one lam per anchor.")
        if not any(self.lams):
            return
        if self.master is not None:  # ZeRO-1/2: the corrected LoRA factors are carried into the fp32 master copy
            self.master.carry(lambda: self.adapters.correct(self.lams, measure_residual))
        else:
            self.adapters.correct(self.lams, measure_residual)
        params = [local_tensor(self.params[i]) for i, _ in self.protected]
        if self.sparse is not None:
            self.sparse.correct(params, self.lams)
        else:
            theta0 = [self.theta0[i] for i, _ in self.protected]
            proximal_pull_(params, theta0, [row for _, row in self.protected], self.lams)
        if self.master is not None:
            self.master.correct(self.lams)

    def footprint(self) -> tuple[int, int]:
        """The memory CFP keeps for the full-parameter coordinates: theta0 and every anchor's F, and in sparse mode the
        kept indices, theta0 and F (LoRA snapshots and DeepSpeed master fragments not counted), each storage once.

        Returns:
            `tuple[int, int]`: (bytes CFP keeps beside the parameters, bytes it keeps offloaded to CPU memory).
        """
        full = [*self.theta0, *(f for _, fishers, _ in self.views.values() for f in fishers)]
        kept = [t for part in (self.sparse.indices, self.sparse.theta0) for t in part] if self.sparse else []
        kept += [f for row in self.sparse.rows for f in row if f is not None] if self.sparse else []
        full_bytes, kept_bytes = (
            sum({t.untyped_storage().data_ptr(): t.nbytes for t in ts}.values()) for ts in (full, kept)
        )
        return (kept_bytes, full_bytes) if self.memory.offloaded else (full_bytes, 0)

    def pull_profile(self, lams: Sequence[float]) -> tuple[int, float, float, float]:
        """How strong the pull P = sum_k lam_k F_k is over this process's full-parameter protected coordinates
        (LoRA-adapted weights not counted); P is computed a tensor at a time.

        Args:
            lams (sequence of `float`): lam_k of each protecting anchor.

        Returns:
            `tuple[int, float, float, float]`: (protected coordinates, the share of them with P > 1, the 99th and the
            99.9th percentile of P).
        """
        strengths = PullStrengths([row for _, row in self.protected], lams)
        count = sum(next(f for f in row if f is not None).numel() for _, row in self.protected)
        if count == 0:
            return 0, 0.0, 0.0, 0.0
        halved = sum(int((s > 1).sum()) for s in strengths) / count
        return count, halved, free_threshold(strengths, 0.99), free_threshold(strengths, 0.999)

    def budget_lams(self, budgets: Sequence[float], tolerance: float = 0.01) -> list[float]:
        """The lams that keep each protecting anchor's predicted KL 0.5 Delta^T F_k Delta (Delta: the corrected
        displacement now in the parameters) within its budget (nats), pulling no harder (`ops.budget`), warm-started
        from the last lams; the same on every process (sums over sharded parameters are all-reduced, one collective
        per evaluation). Not over LoRA-adapted weights: adapters represent the target only in part (refused at bind).

        Args:
            budgets (sequence of `float`): the budget B_k in nats of each protecting anchor.
            tolerance (`float`, *optional*, defaults to `0.01`): the solve's relative tolerance (`ops.budget`).

        Returns:
            `list[float]`: lam_k,t >= 0 of each protecting anchor (0 while its budget holds without a pull).

        Raises:
            CFPArgumentError: a sparse memory plan (dense plans only).
        """
        if self.sparse is not None:
            raise CFPArgumentError("kl_budget needs a dense memory plan (sparse=None): it sums over every coordinate.")
        parts = [
            [(self.params[i], self.theta0[i], row) for i, row in self.protected if self.sharded[i] == s]
            for s in (False, True)
        ]

        def evaluate(lams: Sequence[float]) -> torch.Tensor:
            replicated, sharded = (
                budget_terms(
                    [local_tensor(p) for p, _, _ in part], [t for _, t, _ in part], [r for _, _, r in part], lams
                )
                for part in parts
            )
            if parts[1]:
                sharded = sharded.to(parts[1][0][1].device)
                all_reduce_sum_([sharded])
            return replicated + sharded.cpu()

        return solve_budget(evaluate, budgets, self.lams, tolerance)

    def drift_metrics(self) -> dict[str, float]:
        """`cfp/<anchor>/sensitive_drift`, `cfp/<anchor>/free_drift`, `cfp/<anchor>/predicted_kl` = 0.5
        sensitive_drift^2 per anchor, `cfp/<anchor>/lam` (of the last correction) per protecting anchor, and
        `cfp/total_drift`.

        Each is sqrt(S_replicated + sum over processes of S_shard): sums of squares S over the
        local tensors, where only sharded ones are all-reduced (a replicated tensor counts once).
        Every process returns the same, global values; with sharded parameters every process must
        call this (one collective). Builds no autograd graph: every input is detached.

        Returns:
            `dict[str, float]`: metric key (`hf_cfp.names.LOGGED_METRICS`) -> value.
        """
        keys = drift_keys(self.views)
        fisher_at = {name: dict(zip(view[0], view[1], strict=True)) for name, view in self.views.items()}
        sums = []
        for sharded in (False, True):  # replicated tensors count once; shards are summed across processes
            chosen = [i for i, s in enumerate(self.sharded) if s == sharded]
            views = [DriftView([fisher_at[n].get(i) for i in chosen], view[2]) for n, view in self.views.items()]
            params = [local_tensor(self.params[i]).detach() for i in chosen]
            sums.append(drift_squares(params, [self.theta0[i] for i in chosen], views))
        replicated, shard_sums = sums
        if self.adapted:  # LoRA-adapted weights (not sharded): replicated sums
            for key, value in adapted_drift_sq(self.adapted, self.adapted_views).items():
                replicated[keys.index(key)] += value
        if any(self.sharded):
            shard_sums = shard_sums.to(local_tensor(self.params[self.sharded.index(True)]).device)
            all_reduce_sum_([shard_sums])
        totals = (replicated + shard_sums.cpu()).tolist()
        metrics = {key: math.sqrt(value) for key, value in zip(keys, totals, strict=True)}
        for name in self.views:  # KL(mu_0 || mu_theta) ~ 0.5 Delta^T F Delta on the anchor's calibration prompts
            metrics[PREDICTED_KL.key(name)] = 0.5 * metrics[SENSITIVE_DRIFT.key(name)] ** 2
        for name, lam in zip(self.protecting, self.lams, strict=True):
            metrics[LAM.key(name)] = lam
        if self.adapters.residual is not None:
            metrics[ADAPTER_RESIDUAL.key(self.protecting[0])] = self.adapters.residual
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


def _rows(
    indices: Iterable[int], protecting: list[str], fisher_of: dict[str, dict[int, torch.Tensor]]
) -> dict[int, list[torch.Tensor | None]]:
    """index -> [F of each protecting anchor on it, or None], for the indices some protecting anchor covers."""
    rows = {i: [fisher_of[name].get(i) for name in protecting] for i in indices}
    return {i: row for i, row in rows.items() if any(f is not None for f in row)}
