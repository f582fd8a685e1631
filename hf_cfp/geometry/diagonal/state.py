"""The diagonal geometry's per-step state: the tensors whose F is a diagonal, corrected elementwise, measured and
budgeted coordinate by coordinate.

`DiagonalTensors` is what `CFPState`'s correction, drift metrics and KL budget consume for them: the lists
`ops.correction.proximal_pull_`, `ops.drift.drift_squares` and `ops.budget.budget_terms` take, built once at bind
(only the parameters' local tensors are resolved at each use: FSDP2 and ZeRO-3 may replace them). Sums come in
two parts, over replicated tensors (counted once) and over sharded ones (added across processes by the caller,
one collective for every geometry). It is one `base.GeometryState` of `CFPState`; a Kronecker-factored F is
another (`kronecker.state.KroneckerTensors`).
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ...ops import DriftView, PullStrengths, budget_terms, drift_squares, free_threshold, proximal_pull_
from ..base import NamedFisher, Tracked
from .artifact import TensorsOf
from .binding import BoundTensor
from .sparse import SparseCorrection, SparseReport, coordinate_threshold, mass_threshold, sparse_report


@dataclass(frozen=True)
class PullPart:
    """Some protected tensors as the correction and the budget take them: theta0 and the row of each protecting
    anchor's F (None where one does not cover the tensor) of each."""

    tensors: list[Tracked]
    theta0: list[torch.Tensor]
    rows: list[list[torch.Tensor | None]]

    @classmethod
    def of(cls, tensors: list[Tracked], protecting: Sequence[str]) -> "PullPart":
        return cls(tensors, [t.theta0 for t in tensors], [t.row(protecting) for t in tensors])

    def locals(self) -> list[torch.Tensor]:
        """The parameters' local tensors now."""
        return [t.local() for t in self.tensors]

    def terms(self, lams: Sequence[float]) -> torch.Tensor:
        """`budget_terms` of these tensors now: [KL_k, dKL_k / dlam_k], float64 [2, K] on the CPU."""
        return budget_terms(self.locals(), self.theta0, self.rows, lams)


@dataclass(frozen=True)
class DriftPart:
    """Some tracked tensors as the drift sums take them: theta0, and one `DriftView` per anchor (its F on each
    tensor or None, its threshold)."""

    tensors: list[Tracked]
    theta0: list[torch.Tensor]
    views: list[DriftView]

    @classmethod
    def of(cls, tensors: list[Tracked], thresholds: Mapping[str, float]) -> "DriftPart":
        views = [DriftView([t.fisher.get(name) for t in tensors], threshold) for name, threshold in thresholds.items()]
        return cls(tensors, [t.theta0 for t in tensors], views)

    def squares(self) -> torch.Tensor:
        """`drift_squares` of these tensors now (detached): float64 [1 + 2V] on the CPU, each view's sensitive and free
        sums; nothing at 0 (the total drift is the path's, `protection.path`)."""
        sums = drift_squares([t.local().detach() for t in self.tensors], self.theta0, self.views)
        sums[0] = 0.0
        return sums


class DiagonalTensors:
    """The tracked tensors with a diagonal F, and the protected ones among them (covered by a protecting anchor).

    Args:
        tensors: every tracked tensor (its drift sums run over those some anchor covers with a diagonal F).
        protecting: the protecting anchors' names, in the order of the lams.
        thresholds: every anchor's free-drift threshold, by name, in the order of the metrics.
        sparse: the kept coordinates of the protected tensors (`sparse.SparseCorrection`), or None (dense).
    """

    def __init__(
        self,
        tensors: Sequence[Tracked],
        protecting: Sequence[str],
        thresholds: Mapping[str, float],
        sparse: SparseCorrection | None = None,
    ):
        self.tensors, self.sparse = tensors, sparse
        # a weight a protecting anchor factors is the Kronecker geometry's to correct (under the summed penalty
        # when another protecting anchor covers it with a diagonal F): measured here, not corrected
        protected = [t for t in tensors if t.covered_by(protecting) and not any(a in t.kfac for a in protecting)]
        self.protected = PullPart.of(protected, protecting)
        diagonal = [t for t in tensors if t.fisher]  # what some anchor covers with a diagonal F
        self.replicated_drift = DriftPart.of([t for t in diagonal if not t.sharded], thresholds)
        self.sharded_drift = DriftPart.of([t for t in diagonal if t.sharded], thresholds)
        self.replicated_budget = PullPart.of([t for t in protected if not t.sharded], protecting)
        self.sharded_budget = PullPart.of([t for t in protected if t.sharded], protecting)

    def correct(self, lams: Sequence[float]) -> None:
        """theta <- theta0 + (theta - theta0) / (1 + sum_k lam_k F_k) on every protected tensor (on the kept
        coordinates only, sparse)."""
        params = self.protected.locals()
        if self.sparse is not None:
            self.sparse.correct(params, lams)
        else:
            proximal_pull_(params, self.protected.theta0, self.protected.rows, lams)

    def drift_squares(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(replicated, sharded) `drift_squares` sums, each float64 [1 + 2V] on the CPU."""
        return self.replicated_drift.squares(), self.sharded_drift.squares()

    @property
    def shard_device(self) -> torch.device | None:
        """The device the sharded sums are all-reduced on (the first sharded tensor's), None with none."""
        sharded = self.sharded_drift.tensors
        return sharded[0].local().device if sharded else None

    def budget_terms(self, lams: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor]:
        """(replicated, sharded) `budget_terms` of the protected tensors: [KL_k, dKL_k / dlam_k], float64 [2, K]."""
        return self.replicated_budget.terms(lams), self.sharded_budget.terms(lams)

    def strengths(self, lams: Sequence[float]) -> Sequence[torch.Tensor]:
        """P = sum_k lam_k F_k of every protected tensor, computed when read (for the pull profile)."""
        return PullStrengths(self.protected.rows, lams)

    def kept(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(every anchor's diagonal F of every tracked tensor; the sparse correction's kept indices, theta0 and F, or
        nothing when dense): the tensors CFP keeps for these coordinates (theta0 is the path's)."""
        full = [f for t in self.tensors for f in t.fisher.values()]
        if self.sparse is None:
            return full, []
        kept = [*self.sparse.indices, *self.sparse.theta0]
        return full, kept + [f for row in self.sparse.rows for f in row if f is not None]


def pull_profile(strengths: Sequence[torch.Tensor]) -> tuple[int, float, float, float]:
    """(coordinates, the share of them with P > 1, the 99th and the 99.9th percentile of P) for the pull strengths P
    of some tensors, read a tensor at a time (a lazy sequence is never held whole)."""
    count = sum(s.numel() for s in strengths)
    if count == 0:
        return 0, 0.0, 0.0, 0.0
    halved = sum(int((s > 1).sum()) for s in strengths) / count
    return count, halved, free_threshold(strengths, 0.99), free_threshold(strengths, 0.999)


class Chained(Sequence[torch.Tensor]):
    """Several sequences of tensors read as one, each element computed when read (lazy parts stay lazy)."""

    def __init__(self, *parts: Sequence[torch.Tensor]):
        self.parts = parts

    def __len__(self) -> int:
        return sum(len(part) for part in self.parts)

    def __getitem__(self, i):  # an integer index
        for part in self.parts:
            if i < len(part):
                return part[i]
            i -= len(part)
        raise IndexError(i)


def sparse_correction(
    share: float,
    by: str,
    protecting: Sequence[NamedFisher],
    bound: Mapping[str, list[BoundTensor]],
    tensors: Sequence[Tracked],
) -> tuple[SparseCorrection, SparseReport]:
    """The kept coordinates of the protected `tensors` under a sparse plan keeping the top `share` of each
    protecting anchor's F `by` "coordinates" or "mass", and what they keep: each protecting anchor's threshold over
    its full F on the parameters it binds (the same on every process; `sparse`), the report read from the full F
    one parameter at a time."""
    pick = coordinate_threshold if by == "coordinates" else mass_threshold
    thresholds = [pick(TensorsOf(a.fisher, [t.name for t in bound[a.name]]), share) for a in protecting]
    names = [a.name for a in protecting]
    protected = [t for t in tensors if t.covered_by(names)]
    full_rows = ([a.fisher[t.name] if t.name in a.fisher else None for a in protecting] for t in protected)
    report = sparse_report(full_rows, thresholds)
    correction = SparseCorrection(
        [t.local() for t in protected], [t.theta0 for t in protected], [t.row(names) for t in protected], thresholds
    )
    return correction, report
