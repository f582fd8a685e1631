"""The weights several protecting anchors cover, some of them with Kronecker factors: corrected by the exact
proximal map of the summed penalty (`summed_solve`), measured per anchor in each anchor's eigenbasis.

A weight joins when a protecting K-FAC anchor factors it and another protecting anchor covers it (factored or
with a diagonal F); every other weight keeps one anchor's closed form (`state.KroneckerTensors`,
`diagonal.state.DiagonalTensors`). Weights are solved one at a time. A weight held whole on several processes (DDP) is
solved by one owning process (`state.balanced_owners`, by the products one iteration costs) and the corrected
weights reach the others in one all-reduce per correction; a row-sharded one (FSDP2) is solved by every process on
its rows, each projection and dot product completed by an all-reduce.

The KL budget's closed-form solve (`predicted_kl_budget`) has no form for a summed penalty and is refused; the
measured-KL controller (`kl_budget`) needs none.
"""

import warnings
from collections.abc import Mapping, Sequence

import torch

from ...errors import CFPArgumentError
from ...parallel import all_reduce_sum_, process_rank_and_count
from ..base import Tracked, View
from .artifact import stored_parts
from .basis import KroneckerBasis, no_reduce
from .flat import is_flat_piece
from .pooled import pooled_term
from .proximal import kfac_drift_squares
from .state import balanced_owners
from .summed_solve import MAX_ITERATIONS, TOLERANCE, SummedPenalty, solve_summed


def summed_tensors(tracked: Sequence[Tracked], protecting: Sequence[str]) -> list[Tracked]:
    """The tracked tensors a protecting K-FAC anchor factors and at least one other protecting anchor covers.

    Raises:
        CFPArgumentError: such a tensor held as a flat piece (FSDP1, DeepSpeed ZeRO).
    """
    several = [
        t
        for t in tracked
        if any(name in t.kfac for name in protecting)
        and sum(name in t.kfac or name in t.fisher for name in protecting) > 1
    ]
    pieces = [t.name for t in several if is_flat_piece(t)]
    if pieces:
        raise CFPArgumentError(
            f"Several protecting anchors {list(protecting)} cover {pieces[0]!r}, a K-FAC weight held as a flat piece "
            "(FSDP1 or DeepSpeed ZeRO): their summed penalty is solved on whole weights or row shards only. Train "
            "with DDP or FSDP2 (fully_shard), or protect with one anchor (estimated on the capabilities' prompts "
            "together) and pass the others as monitor=."
        )
    return several


def _wide(basis: KroneckerBasis) -> KroneckerBasis:
    """`basis` with float64 eigenvectors (the solve's dtype)."""
    return basis.placed(basis.a_vectors.device, torch.float64)


def _reduce(sharded: bool):
    """An all-reduce for a row-sharded weight's partial sums; nothing for one held whole."""
    return all_reduce_sum_ if sharded else no_reduce


class SummedTensors:
    """The weights under a summed penalty, with every anchor's basis on them for the drift metrics.

    Args:
        tensors: the weights (`summed_tensors`).
        views: every anchor's view, in the order of the metrics.
        protecting: the protecting anchors' names, in the order of the lams.
    """

    def __init__(self, tensors: list[Tracked], views: Mapping[str, View], protecting: Sequence[str]):
        self.tensors, self.protecting = tensors, list(protecting)
        self.order, self.thresholds = list(views), {name: view.threshold for name, view in views.items()}
        self.bases = [dict(t.kfac) for t in tensors]  # as bound (float32), cast to float64 for each solve
        self.pooled: list[tuple[tuple, float, KroneckerBasis, float] | None] = [None] * len(tensors)
        rank, world = process_rank_and_count()
        self.split = world > 1 and any(not t.sharded for t in tensors)
        costs = [t.param.numel() * sum(b.a_values.shape[-1] for b in bases.values()) for t, bases in self._pairs()]
        owners = balanced_owners(costs, world) if self.split else [rank] * len(tensors)
        self.owned = [owner == rank or t.sharded for owner, t in zip(owners, tensors, strict=True)]
        self.mean_iterations = 0.0  # conjugate-gradient iterations per weight in the last correction
        self._warned: set[str] = set()

    def _pairs(self):
        return zip(self.tensors, self.bases, strict=True)

    def __bool__(self) -> bool:
        return bool(self.tensors)

    def penalty(self, i: int, lams: Sequence[float]) -> SummedPenalty:
        """Weight i's summed penalty with the protecting anchors' lams (its out x in orientation), float64."""
        t, bases = self.tensors[i], self.bases[i]
        pairs = list(zip(self.protecting, lams, strict=True))
        factored = [(_wide(bases[name]), float(lam)) for name, lam in pairs if name in bases]
        rows = [t.oriented(t.fisher[name]).double() * float(lam) for name, lam in pairs if name in t.fisher]
        return SummedPenalty(factored, sum(rows[1:], rows[0]) if rows else None)

    def preconditioner(self, i: int, penalty: SummedPenalty) -> tuple[KroneckerBasis, float]:
        """Weight i's pooled term (`pooled`), the preconditioner of a penalty with a diagonal term, kept (float32
        eigenvectors) while the ratios of the lams stay within 1e-3: s follows their sum."""
        lams = [lam for _, lam in penalty.factored]
        if len(lams) == 1:  # one K-FAC term (beside diagonal ones): its own closed form
            return penalty.preconditioner()
        total = sum(lams)
        key = tuple(round(lam / total, 3) for lam in lams)
        kept = self.pooled[i]
        if kept is None or kept[0] != key:
            basis, s = pooled_term(penalty.factored, _reduce(self.tensors[i].sharded))
            kept = self.pooled[i] = (key, total, basis.placed(basis.a_vectors.device), s)
        return _wide(kept[2]), kept[3] * total / kept[1]

    @torch.no_grad()
    def correct(self, lams: Sequence[float]) -> None:
        """theta <- theta0 + X with X the summed proximal map at theta - theta0, on every weight; under DDP each
        weight by its owner, then one all-reduce (with the iteration counts). Sets `mean_iterations`."""
        if not self.tensors:
            return
        # [iterations, weights] of the replicated weights (each solved by its owner) and of the sharded ones (solved
        # alike by every process)
        counts = torch.zeros(2, dtype=torch.float64, device=self.tensors[0].local().device)
        local = torch.zeros(2, dtype=torch.float64)
        for i, t in enumerate(self.tensors):
            weight = t.oriented(t.local())
            if not self.owned[i]:
                weight.zero_()
                continue
            start = t.oriented(t.theta0)
            penalty = self.penalty(i, lams)
            pooled = None if penalty.diagonal is None else self.preconditioner(i, penalty)  # K-FAC alone: by blocks
            solve = solve_summed((weight - start).double(), penalty, _reduce(t.sharded), preconditioner=pooled)
            weight.copy_(solve.x.add_(start))
            tally = local if t.sharded else counts
            tally += torch.tensor([solve.iterations, 1.0], dtype=torch.float64, device=tally.device)
            if solve.residual > TOLERANCE and t.name not in self._warned:
                self._warned.add(t.name)
                warnings.warn(
                    f"CFP: the summed proximal map of {t.name!r} stopped at relative residual {solve.residual:.2e} "
                    f"after {solve.iterations} conjugate-gradient iterations (the cap is {MAX_ITERATIONS}); its "
                    "correction is approximate. Lower the strongest lam, or protect this weight with fewer anchors.",
                    stacklevel=2,
                )
        if self.split:
            all_reduce_sum_([t.local() for t in self.tensors if not t.sharded] + [counts])
        total = counts.cpu() + local
        self.mean_iterations = float(total[0] / total[1]) if total[1] > 0 else 0.0

    @torch.no_grad()
    def drift_squares(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(replicated, sharded) float64 [1 + 2V]: per K-FAC anchor v on these weights its sensitive sum at 1 + 2v
        and its free part at 2 + 2v (`basis.kfac_drift_squares`; nothing at 0, the total drift runs over every
        tracked tensor in `DiagonalTensors`)."""
        size = 1 + 2 * len(self.order)
        replicated, sharded = torch.zeros(size, dtype=torch.float64), torch.zeros(size, dtype=torch.float64)
        for t, bases in self._pairs():
            delta = t.oriented(t.local()) - t.oriented(t.theta0)
            for name, basis in bases.items():
                v = self.order.index(name)
                complete, local = kfac_drift_squares([delta], [basis], self.thresholds[name], _reduce(t.sharded))
                replicated[1 + 2 * v] += complete[0]
                replicated[2 + 2 * v] += complete[1]
                (sharded if t.sharded else replicated)[2 + 2 * v] += local[0]
        return replicated, sharded

    def budget_terms(self, lams: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor]:
        """Nothing without weights (float64 [2, K] zeros, twice); refused with some: the predicted KL after a summed
        correction has no closed form in the lams."""
        if not self.tensors:
            nothing = torch.zeros(2, len(self.protecting), dtype=torch.float64)
            return nothing, nothing.clone()
        raise CFPArgumentError(
            f"predicted_kl_budget cannot solve the lams of several protecting anchors on the same K-FAC weight "
            f"({self.tensors[0].name!r} and {len(self.tensors) - 1} more): use kl_budget (the measured KL, "
            "controlled per anchor), or protect each weight with one anchor."
        )

    def strengths(self, lams: Sequence[float]) -> Sequence[torch.Tensor]:
        """Per weight, lam_k e of every coordinate of its strongest K-FAC term (the largest lam_k x trace): a lower
        bound, eigenvalue by ordered eigenvalue, of the summed pull (Weyl: adding a PSD term raises none)."""
        strongest = []
        for t, bases in self._pairs():
            shape = tuple(t.oriented(t.param).shape)
            terms = [
                bases[n].coordinate_weights(*shape).mul_(float(lam))
                for n, lam in zip(self.protecting, lams, strict=True)
                if n in bases
            ]
            strongest.append(max(terms, key=lambda pull: float(pull.sum())))
        return strongest

    def kept(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(the eigenbases CFP keeps for these weights, with the pooled ones of the last correction; nothing
        offloaded)."""
        pooled = [kept[2] for kept in self.pooled if kept is not None]
        bases = [b for per in self.bases for b in per.values()] + pooled
        return [p for b in bases for p in stored_parts(b).values()], []

    @property
    def shard_device(self) -> torch.device | None:
        """The device the sharded sums are all-reduced on (a row-sharded weight's), None with none."""
        sharded = [t for t in self.tensors if t.sharded]
        return sharded[0].local().device if sharded else None
