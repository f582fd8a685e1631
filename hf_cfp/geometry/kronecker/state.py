"""The Kronecker geometry's per-step state: the weights whose F is Kronecker-factored, corrected, measured and
budgeted in their factors' eigenbases.

`KroneckerTensors` is what `CFPState` adds beside the diagonal geometry's state for the weights of K-FAC anchors
(`basis` and `proximal` state the math). Weights of one shape are rotated together, up to `BATCH` at a time (batched
products). A weight held whole is rotated locally; replicated on several processes (DDP), each batch is corrected
by one owning process (`balanced_owners`, by FLOPs) and the corrected weights reach the others in one all-reduce
per correction (their values, zeros from the other processes: 2 bytes per bfloat16 parameter, like a gradient
all-reduce). One whose rows are sharded (FSDP2) is rotated as a partial sum over its rows, completed by an
all-reduce of the batch's partial sums (r_G x r_A floats per weight, and with a tail r_G x in + r_A + 1 more; one
collective per batch, per correction and per metrics call). Its drift sums come,
like the diagonal ones, as float64 [1 + 2V] vectors in the metric order of `names.drift_keys`: the rotated sums are
complete on every process (replicated), the sum of Delta^2 of sharded rows is added across processes by the caller.
A weight held as a flat piece (FSDP1, DeepSpeed ZeRO-3) is corrected one weight at a time on the rows its piece
touches (`flat`): one all-reduce per weight and projection, of r_G r_A + r_G in + out r_A + 1 floats.
"""

from collections.abc import Mapping, Sequence

import torch

from ...errors import CFPArgumentError
from ...parallel import all_reduce_sum_, process_rank_and_count
from ..base import Adapted, Tracked, View
from .artifact import stored_parts
from .basis import KroneckerBasis, Projection, projected
from .flat import FlatPieces, HeldPiece, is_flat_piece
from .proximal import kfac_budget_terms, kfac_drift_squares, pull_

BATCH = 8  # weights of one shape rotated together: batched products (on a GPU, far fewer kernel launches)


class _Batch:
    """Up to BATCH weights of one anchor with one shape, dtype and device: their bases stacked (n x ...), in the
    weights' dtype for bfloat16 / float16 weights (float32 otherwise); each tracked tensor's basis becomes a view
    of its slice, so the bases are held once. Their displacements are stacked per use (n weights' worth); each
    weight is corrected in place."""

    def __init__(self, anchor: str, tensors: list[Tracked]):
        self.tensors = tensors
        dtype = tensors[0].param.dtype
        dtype = dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32
        device = tensors[0].param.device
        self.basis = KroneckerBasis.stacked([t.kfac[anchor].placed(device, dtype) for t in tensors])
        for i, t in enumerate(tensors):
            t.kfac[anchor] = self.basis[i]

    def weights(self) -> list[torch.Tensor]:
        """The weights now, as out x in views of what this process holds."""
        return [t.oriented(t.local()) for t in self.tensors]

    @torch.no_grad()
    def displacements(self) -> torch.Tensor:
        """theta - theta0 of every weight, stacked (n x out x in) in the bases' dtype."""
        weights = self.weights()
        stacked = weights[0].new_empty((len(weights), *weights[0].shape), dtype=self.basis.a_vectors.dtype)
        for t, weight, delta in zip(self.tensors, weights, stacked, strict=True):
            torch.sub(weight, t.oriented(t.theta0), out=delta)
        return stacked


class _Factored:
    """One anchor's K-FAC weights of one kind (held whole, or row-sharded), in batches of like weights."""

    def __init__(self, anchor: str, tensors: list[Tracked], sharded: bool):
        self.anchor, self.sharded = anchor, sharded
        kinds: dict[tuple, list[Tracked]] = {}
        for t in tensors:  # keyed by the full shape: every process forms the same batches (their collectives match)
            basis, local = t.kfac[anchor], t.oriented(t.local())
            key = (
                tuple(t.param.shape),
                tuple(basis.a_vectors.shape),
                basis.g_vectors.shape[1],
                local.dtype,
                basis.tailed,
            )
            kinds.setdefault((*key, local.device), []).append(t)
        self.batches = [
            _Batch(anchor, same[i : i + BATCH]) for same in kinds.values() for i in range(0, len(same), BATCH)
        ]
        rank, world = process_rank_and_count()
        split = not sharded and world > 1  # replicated weights (DDP): each batch corrected by one process
        owners = balanced_owners([_flops(b) for b in self.batches], world) if split else [rank] * len(self.batches)
        self.owned = [owner == rank for owner in owners]
        self.split = split

    def reduce(self, partials: list[torch.Tensor]) -> None:
        """Complete partial projections of row-sharded weights (one all-reduce); nothing for whole ones."""
        if self.sharded and partials:
            all_reduce_sum_(partials)

    def rotated(self, batch: _Batch) -> Projection:
        """The projection of theta - theta0 of one batch now (`basis.Projection`, n stacked), complete."""
        return projected([batch.displacements()], [batch.basis], self.reduce)[0]

    def proposals(self) -> list[Projection]:
        """`rotated` of every batch."""
        return [self.rotated(b) for b in self.batches]

    @torch.no_grad()
    def pull_(self, lam: float, rotated: list[Projection] | None = None) -> None:
        """Every weight pulled in place from its batch's projected proposal (`basis.pull_`;
        projected here one batch at a time unless given). Under DDP a process zeroes the
        weights of the batches others own, and one all-reduce brings every weight the owner's value."""
        for i, batch in enumerate(self.batches):
            if not self.owned[i]:
                for weight in batch.weights():
                    weight.zero_()
                continue
            r = rotated[i] if rotated is not None else self.rotated(batch)
            pull_(batch.weights(), [t.oriented(t.theta0) for t in batch.tensors], batch.basis, r, lam)
        if self.split:
            all_reduce_sum_([t.local() for batch in self.batches for t in batch.tensors])

    @torch.no_grad()
    def drift(self, threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(complete, local) `basis.kfac_drift_squares` over every batch."""
        complete, local = torch.zeros(2, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
        for b in self.batches:
            found = kfac_drift_squares([b.displacements()], [b.basis], threshold, self.reduce)
            complete, local = complete + found[0], local + found[1]
        return complete, local


def _flops(batch: _Batch) -> int:
    """The multiply-adds of one batch's correction, about 4 out in r per weight (`basis`)."""
    basis = batch.basis
    out_dim, rank = basis.g_vectors.shape[-2], max(basis.a_values.shape[-1], basis.g_values.shape[-1])
    return len(batch.tensors) * out_dim * basis.a_vectors.shape[-2] * rank


def balanced_owners(costs: Sequence[int], processes: int) -> list[int]:
    """The process that owns each item: largest first, each to the least loaded process so far (ties: the lowest
    rank), the same on every process."""
    loads = [0] * processes
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        owners[i] = min(range(processes), key=lambda p: (loads[p], p))
        loads[owners[i]] += costs[i]
    return owners


class KroneckerTensors:
    """The K-FAC weights of every anchor, and the protected ones (those of protecting anchors).

    Args:
        views: every anchor's view (`base.View`), in the order of the metrics.
        protecting: the protecting anchors' names, in the order of the lams.
        summed: the weights under several protecting anchors (`summed.SummedTensors` corrects and measures them),
            left out here.
    """

    def __init__(self, views: Mapping[str, View], protecting: Sequence[str], summed: Sequence[Tracked] = ()):
        self.order = list(views)
        solved = {id(t) for t in summed}
        own = {name: [t for t in view.kronecker if id(t) not in solved] for name, view in views.items()}
        self.groups: list[_Factored | FlatPieces] = [
            _Factored(name, [t for t in tensors if t.sharded == sharded and not is_flat_piece(t)], sharded)
            for name, tensors in own.items()
            for sharded in (False, True)
            if any(t.sharded == sharded and not is_flat_piece(t) for t in tensors)
        ]
        self.groups += [
            FlatPieces(name, pieces)
            for name, tensors in own.items()
            if (pieces := [t for t in tensors if is_flat_piece(t)])
        ]
        self.thresholds = {name: view.threshold for name, view in views.items()}
        self.protecting = list(protecting)
        self._proposal: list[list[Projection]] | None = None  # from a budget solve to the correction after it

    def __bool__(self) -> bool:
        return bool(self.groups)

    def protected(self) -> list[tuple[int, "_Factored | FlatPieces"]]:
        return [(self.protecting.index(g.anchor), g) for g in self.groups if g.anchor in self.protecting]

    def proposal(self) -> list[list[Projection]]:
        """The protected weights' projected proposals, per group and batch, kept until `forget` or the correction
        (the KL budget's solve and the correction that follows it project once; held meanwhile: r_G x r_A floats
        per weight, and with a tail (out + in) r more)."""
        if self._proposal is None:
            self._proposal = [g.proposals() for _, g in self.protected()]
        return self._proposal

    def forget(self) -> None:
        """Drop the kept proposals: the weights may have changed since. `CFPState` calls it before every solve, since
        an optimizer may write the weights without a trace (a fused AdamW leaves their version counters as they
        were)."""
        self._proposal = None

    def correct(self, lams: Sequence[float]) -> None:
        """Delta <- the proximal map of (lam / 2) tr(X^T G_r X A_r) at the proposal (`basis.kfac_pull_`) on every
        protected weight, with its anchor's lam: from the kept proposals after a budget solve, else projecting one
        batch at a time (its temporaries: a few stacks of BATCH weights)."""
        kept, self._proposal = self._proposal, None
        for n, (k, group) in enumerate(self.protected()):
            group.pull_(lams[k], kept[n] if kept is not None else None)

    def drift_squares(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(replicated, sharded) float64 [1 + 2V]: per anchor v, sum gamma alpha R^2 at 1 + 2v and the free part at
        2 + 2v (complete rotated sums replicated, the rows' Delta^2 where they are held); nothing at 0 (the total
        drift runs over the tracked tensors in `DiagonalTensors`)."""
        size = 1 + 2 * len(self.order)
        replicated, sharded = torch.zeros(size, dtype=torch.float64), torch.zeros(size, dtype=torch.float64)
        for group in self.groups:
            v = self.order.index(group.anchor)
            complete, local = group.drift(self.thresholds[group.anchor])
            replicated[1 + 2 * v] += complete[0]
            replicated[2 + 2 * v] += complete[1]
            (sharded if group.sharded else replicated)[2 + 2 * v] += local[0]
        return replicated, sharded

    def budget_terms(self, lams: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor]:
        """(complete, nothing to add across processes): [KL_k, dKL_k / dlam_k] of the protected K-FAC weights
        (float64 [2, K], complete on every process) for the projected proposals (`basis.kfac_budget_terms`)."""
        terms = torch.zeros(2, len(self.protecting), dtype=torch.float64)
        for (k, group), rotated in zip(self.protected(), self.proposal(), strict=True):
            terms[:, k] += kfac_budget_terms(rotated, [b.basis for b in group.batches], lams[k])
        return terms, torch.zeros_like(terms)

    @property
    def shard_device(self) -> torch.device | None:
        """The device the sharded sums are all-reduced on (a row-sharded weight's), None with none."""
        sharded = [t for g in self.groups if g.sharded for b in g.batches for t in b.tensors]
        return sharded[0].local().device if sharded else None

    def strengths(self, lams: Sequence[float]) -> Sequence[torch.Tensor]:
        """lam_k e for the eigenvalue e of every coordinate of every protected weight (`KroneckerBasis.
        coordinate_weights`; of the whole weight), a weight at a time, computed when read (for the pull profile)."""
        return _Strengths(
            [
                (t.kfac[group.anchor], _weight_shape(t, t.kfac[group.anchor]), float(lams[k]))
                for k, group in self.protected()
                for b in group.batches
                for t in b.tensors
            ]
        )

    def kept(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(the eigenbases CFP keeps for these weights, nothing offloaded)."""
        bases = [b.basis for g in self.groups for b in g.batches]
        return [t for b in bases for t in stored_parts(b).values()], []


def _weight_shape(t: HeldPiece, basis: KroneckerBasis) -> tuple[int, int]:
    """(out, in) of the whole K-FAC weight, however this process holds it."""
    in_dim = basis.a_vectors.shape[-2]
    return t.held.numel // in_dim, in_dim


class _Strengths(Sequence[torch.Tensor]):
    """lam e of every coordinate of each (basis, out x in shape, lam), computed when read."""

    def __init__(self, entries: list[tuple[KroneckerBasis, tuple[int, ...], float]]):
        self.entries = entries

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, i):  # an integer index
        basis, shape, lam = self.entries[i]
        return basis.coordinate_weights(*shape).mul_(lam)


def refuse_unsolvable(
    adapted: Sequence[Adapted], protecting: Sequence[str], sparse: bool, kronecker: KroneckerTensors
) -> None:
    """CFPArgumentError for what has no exact correction with K-FAC anchors: a LoRA-adapted weight factored by one
    protecting anchor and covered by another (the adapter rules solve one anchor's closed form), and a `sparse`
    memory plan (it keeps coordinates of a diagonal F)."""
    for a in adapted:
        factoring = [name for name in protecting if name in a.kfac]
        covering = [name for name in protecting if name in a.fisher or name in a.kfac]
        if factoring and len(covering) > 1:
            raise CFPArgumentError(
                f"Protecting anchors {covering} all cover the LoRA-adapted weight {a.weight.name!r}, and "
                f"{factoring[0]!r} is Kronecker-factored: the LoRA rules solve one K-FAC anchor per adapted weight. "
                "Protect it with one of them and pass the others as monitor= (their drift is still logged), or "
                "train the weight in full (several protecting anchors are solved exactly on full weights)."
            )
    if sparse and kronecker.protected():
        raise CFPArgumentError(
            "sparse keeps the top coordinates of a diagonal F; a protecting K-FAC anchor has none on its factored "
            "weights. Use sparse=None with a K-FAC anchor (kfac_rank truncates it instead)."
        )


def adapted_kronecker_squares(adapted: Sequence[Adapted], views: Mapping[str, View]) -> torch.Tensor:
    """The K-FAC anchors' sensitive and free sums over the LoRA-adapted weights they factor, float64 [1 + 2V] in the
    metric order (nothing at 0: `protection.peft_adapters.adapted_drift_sq` sums every adapted weight's Delta_W^2): the
    merged displacement Delta_W = s B A - s0 B0 A0 in the base weight's eigenbases (one process holds it whole)."""
    sums = torch.zeros(1 + 2 * len(views), dtype=torch.float64)
    for v, (name, view) in enumerate(views.items()):
        for record in (a for a in adapted if name in a.kfac):
            delta = record.weight.in_factor_orientation(record.weight.displacement())
            complete, local = kfac_drift_squares([delta], [record.kfac[name]], view.threshold)
            sums[1 + 2 * v] += complete[0]
            sums[2 + 2 * v] += complete[1] + local[0]
    return sums
