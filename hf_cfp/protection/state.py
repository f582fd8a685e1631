"""CFP state for one model: theta0 snapshot, per-step correction, drift metrics (no Trainer needed).

Each process keeps theta0 and F for what it holds (full parameters under DDP, its pieces under
FSDP2, FSDP1 and ZeRO-3), corrects that alone, and adds its shards' sums of squares to the other processes' ones.
"""

import math
from collections.abc import Sequence

import torch

from ..anchor import FisherAnchor
from ..errors import CFPArgumentError, plural
from ..geometry import GEOMETRIES
from ..geometry import geometry as registered
from ..geometry.base import Bound, GeometryState, complete
from ..geometry.diagonal.binding import bind_anchor
from ..geometry.diagonal.state import Chained, DiagonalTensors, pull_profile, sparse_correction
from ..geometry.kronecker.binding import bind_kronecker
from ..geometry.kronecker.master import kronecker_master
from ..geometry.kronecker.state import KroneckerTensors, adapted_kronecker_squares, refuse_unsolvable
from ..geometry.kronecker.summed import SummedTensors
from ..names import ADAPTER_RESIDUAL, LAM, PREDICTED_KL, SENSITIVE_DRIFT, SUMMED_ITERATIONS, drift_keys
from ..ops import DriftView, solve_budget
from ..parallel.deepspeed import master_correction
from .adapter_correction import AdapterCorrection
from .memory import MemoryPlan
from .path import Path
from .peft_adapters import adapted_drift_sq, peft_view
from .records import AdaptedTensor, adapted_tensors, anchor_views, track
from .theta0 import Theta0Pieces, Theta0Reader


class CFPState:
    """Binds protecting anchors and monitor anchors to `model` and snapshots theta0.

    theta0 is kept for every trainable parameter any anchor covers, so `cfp/total_drift` = ||theta - theta0|| runs
    over that union. Only the protecting anchors correct, by the proximal map of their summed penalty: theta <- theta0
    + (theta - theta0) / (1 + sum_k lam_k F_k) on diagonal coordinates, one pass; one K-FAC anchor's closed form on a
    weight it alone protects; conjugate gradient on a weight several protect, one of them K-FAC (`summed`). theta0
    and F are this process's part of each parameter (the local shard of a DTensor); the free-drift threshold comes
    from the anchor's full F, so it is the same on every process.

    On a `peft.PeftModel` the anchors are keyed by the base model's names (`peft_adapters`): trained base parameters
    (`modules_to_save` copies, trained biases) bind as above, and a LoRA-adapted base weight is measured by its
    merged displacement Delta_W = s B A - s0 B0 A0 (`adapted`) and corrected through its LoRA factors (`lora_rule`).

    What it holds, as named records (`records`): `tensors`, one `TrackedTensor` per covered trainable parameter
    (theta0, held range, each anchor's F); `views`, one `AnchorView` per anchor (its tensors, its free-drift
    threshold); `path`, theta0 and the total drift of the tracked tensors, which belong to no geometry (`path`);
    `adapted` and `adapters`, the LoRA-adapted weights and their correction. Each structure of F keeps its per-step
    state (`geometry.base.GeometryState`) in `geometries` beside the path (`diagonal`, the tensors whose F is a
    diagonal, `geometry.diagonal.state`; `kronecker`, the weights K-FAC anchors factor, and `summed`, the weights
    under several protecting anchors, some K-FAC, `geometry.kronecker`): every method below runs them alike, with
    no branch on the structure.

    Args:
        model (`torch.nn.Module`): the model being trained (plain or PEFT; under DDP, FSDP2, FSDP1 or ZeRO).
        anchor ([`FisherAnchor`] or a sequence of them): the protecting anchor(s).
        monitors (sequence of [`FisherAnchor`], *optional*, defaults to `()`): anchors measured, not corrected.
        free_fraction (`float`, *optional*, defaults to `0.99`): the smallest-F share `free_drift` runs over.
        optimizer (`torch.optim.Optimizer`, *optional*): under DeepSpeed ZeRO, its fp32 masters are corrected too.
        theta0 (`Theta0Reader`, *optional*): a saved theta0 (`checkpoint.SavedTheta0`) restored instead of a snapshot
            of the weights: resuming, under any number of processes (on a PeftModel, the LoRA factors at train begin).
        lora_rule (`str`, *optional*, defaults to `"proximal_b"`): "proximal_b", "least_squares_b" or "factor_space"
            (`geometry.diagonal.lora`).
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
        memory = memory or MemoryPlan()
        anchors = (*protecting, *monitors)
        names = [a.name for a in protecting]
        view = peft_view(model)
        bound = {a.name: bind_anchor(a, model, view.params if view else None, memory.store_fisher) for a in anchors}
        factored = {a.name: bind_kronecker(a, model, view.params if view else None) for a in anchors if a.kfac}
        adapted = adapted_tensors(view.adapted if view else {}, anchors)
        if adapted and theta0 is not None:
            theta0.restore_lora([a.weight for a in adapted])  # the path's origin: the factors at train begin
        tracked = track(bound, memory, theta0, factored)
        views = anchor_views(anchors, bound, tracked, adapted, free_fraction)
        sparse, report = (
            sparse_correction(float(memory.sparse), memory.sparse_by, protecting, bound, tracked)
            if memory.sparse is not None
            else (None, None)
        )
        states = {name: registered(name).states(Bound(tracked, views, names, sparse)) for name in GEOMETRIES}
        (diagonal,), (kronecker, summed) = states["diagonal"], states["kronecker"]  # what the checks below read
        assert isinstance(diagonal, DiagonalTensors) and isinstance(kronecker, KroneckerTensors)
        assert isinstance(summed, SummedTensors)
        refuse_unsolvable(adapted, names, memory.sparse is not None, kronecker)
        adapters = _adapter_correction(adapted, names, lora_rule)
        # DeepSpeed ZeRO: also correct the optimizer's fp32 master partitions (None otherwise).
        protected = diagonal.protected
        params = [t.param for t in protected.tensors]
        master = master_correction(
            model, optimizer, params, protected.theta0, protected.rows, followed=adapters.factor_params()
        )
        _refuse_under_zero(master is not None, sparse is not None, summed)
        kronecker_fp32 = kronecker_master(optimizer, kronecker)
        self.model, self.memory, self.protecting = model, memory, names
        self.lams = [0.0] * len(protecting)  # of the last correction
        self.tensors, self.views, self.diagonal, self.kronecker = tracked, views, diagonal, kronecker
        self.summed = summed
        self.path = Path(tracked, len(views))  # theta0 and the total drift: no geometry's
        # every registered geometry's states, in the registry's order, beside the path
        self.geometries: tuple[GeometryState, ...] = (self.path, *(s for name in GEOMETRIES for s in states[name]))
        self.adapted, self.adapters, self._adapted = [a.weight for a in adapted], adapters, adapted
        self._adapted_views = [
            DriftView([a.fisher.get(name) for a in adapted], v.threshold) for name, v in views.items()
        ]
        self.sparse, self.sparse_report, self.master = sparse, report, master
        self.kronecker_master = kronecker_fp32

    @property
    def names(self) -> list[str]:
        """The names of the tracked parameters (`tensors`), in order."""
        return [t.name for t in self.tensors]

    @property
    def theta0(self) -> list[torch.Tensor]:
        """theta0 of each tracked parameter (this process's part), in the order of `names` (the path's origin)."""
        return self.path.theta0

    def theta0_pieces(self) -> Theta0Pieces:
        """This state's theta0 pieces and LoRA factors at train begin, as a `Theta0Reader`: a state binding other
        anchors to the same model (a refreshed F) keeps the path's origin, and `CFP.state_dict` saves them."""
        snapshots = {weight.name: weight.snapshot for weight in self.adapted}
        return Theta0Pieces({t.name: t.theta0 for t in self.tensors}, snapshots, "the anchors bound before")

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
            self.kronecker.forget()  # what a solve kept is of this step's weights only
            return
        if self.master is not None:  # ZeRO-1/2: the corrected LoRA factors are carried into the fp32 master copy
            self.master.carry(lambda: self.adapters.correct(self.lams, measure_residual))
        else:
            self.adapters.correct(self.lams, measure_residual)
        for geometry in self.geometries:
            geometry.correct(self.lams)
        if self.master is not None:
            self.master.correct(self.lams)
        if self.kronecker_master is not None:
            self.kronecker_master.correct(self.lams)

    def footprint(self) -> tuple[int, int]:
        """The memory CFP keeps for the full-parameter coordinates: theta0 and every anchor's F, and in sparse mode the
        kept indices, theta0 and F (LoRA snapshots and DeepSpeed master fragments not counted), each storage once.

        Returns:
            `tuple[int, int]`: (bytes CFP keeps beside the parameters, bytes it keeps offloaded to CPU memory).
        """
        parts = [geometry.kept() for geometry in self.geometries]
        full, kept = [t for part, _ in parts for t in part], [t for _, part in parts for t in part]
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
        return pull_profile(Chained(*(geometry.strengths(lams) for geometry in self.geometries)))

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
            raise CFPArgumentError(
                "predicted_kl_budget needs a dense memory plan (sparse=None): it sums over every coordinate."
            )

        def evaluate(lams: Sequence[float]) -> torch.Tensor:
            return complete(self.geometries, [geometry.budget_terms(lams) for geometry in self.geometries])

        self.kronecker.forget()  # project the weights as they are now, kept for the correction that follows
        return solve_budget(evaluate, budgets, self.lams, tolerance)

    @property
    def solves_budget(self) -> bool:
        """Whether `budget_lams` can solve the lams here: a dense plan, no LoRA-adapted weight, no weight under
        several protecting anchors one of which is K-FAC."""
        return self.sparse is None and not self.adapted and not self.summed

    def predicted_kls(self) -> list[float]:
        """Each protecting anchor's predicted KL 0.5 Delta^T F_k Delta of the displacement in the parameters now
        (the terms `budget_lams` evaluates, at lams 0; dense plans, no LoRA-adapted weight)."""
        zeros = [0.0] * len(self.protecting)
        self.kronecker.forget()
        predicted = complete(self.geometries, [g.budget_terms(zeros) for g in self.geometries])[0].tolist()
        self.kronecker.forget()  # a correction without a solve projects afresh
        return predicted

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
        parts = [geometry.drift_squares() for geometry in self.geometries]
        if self.adapted:  # LoRA-adapted weights (not sharded): replicated sums
            nothing = torch.zeros(len(keys), dtype=torch.float64)
            parts.append((adapted_drift_sq(self.adapted, self._adapted_views), nothing))
            parts.append((adapted_kronecker_squares(self._adapted, self.views), nothing))
        totals = complete(self.geometries, parts).tolist()
        metrics = {key: math.sqrt(value) for key, value in zip(keys, totals, strict=True)}
        for name in self.views:  # KL(mu_0 || mu_theta) ~ 0.5 Delta^T F Delta on the anchor's calibration prompts
            metrics[PREDICTED_KL.key(name)] = 0.5 * metrics[SENSITIVE_DRIFT.key(name)] ** 2
        for name, lam in zip(self.protecting, self.lams, strict=True):
            metrics[LAM.key(name)] = lam
        if self.adapters.residual is not None:
            metrics[ADAPTER_RESIDUAL.key(self.protecting[0])] = self.adapters.residual
        if self.summed:
            metrics[SUMMED_ITERATIONS.key()] = self.summed.mean_iterations
        return metrics


def _refuse_under_zero(zero: bool, sparse: bool, summed: SummedTensors) -> None:
    """Under DeepSpeed ZeRO, refuse what its fp32 master copy cannot follow: a sparse plan, several protecting
    anchors on one K-FAC weight."""
    if zero and sparse:
        raise CFPArgumentError("Under DeepSpeed ZeRO, CFP needs a dense memory plan (sparse=None).")
    if zero and summed:
        raise CFPArgumentError(
            f"Under DeepSpeed ZeRO, several protecting anchors {summed.protecting} cover the K-FAC weight "
            f"{summed.tensors[0].name!r}: their summed penalty is not solved on the fp32 master fragments. Train "
            "with DDP or FSDP2 (fully_shard), or protect with one anchor (estimated on the capabilities' prompts "
            "together) and pass the others as monitor=."
        )


def _adapter_correction(adapted: list[AdaptedTensor], protecting: list[str], rule: str) -> AdapterCorrection:
    """The correction of the adapted weights some protecting anchor covers, with each protecting anchor's F."""
    covered = [a for a in adapted if any(name in a.fisher for name in protecting)]
    factored = [  # a K-FAC protecting anchor covers its weights alone (`kronecker.refuse_unsolvable`)
        (a.weight, k, a.kfac[name]) for a in adapted for k, name in enumerate(protecting) if name in a.kfac
    ]
    return AdapterCorrection(
        [a.weight for a in covered], [[a.fisher.get(name) for name in protecting] for a in covered], rule, factored
    )
