"""What a bound CFPState holds, as named records built by pure functions from the anchors' bindings.

- `TrackedTensor`: one trainable parameter some anchor covers, as this process holds it (a replica, or an FSDP /
  ZeRO-3 piece): its theta0, the diagonal F of every anchor covering it that way, and the Kronecker eigenbases
  (`geometry.kronecker.basis.KroneckerBasis`) of every K-FAC anchor factoring it.
- `AdaptedTensor`: one LoRA-adapted base weight some anchor covers (a PeftModel): its factors' snapshot and the
  F of every anchor covering it.
- `AnchorView`: one anchor as its metrics see it: the tensors it covers and its free-drift threshold.
"""

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ..anchor import FisherAnchor
from ..geometry.binding import HeldRange
from ..geometry.diagonal.artifact import TensorsOf
from ..geometry.diagonal.binding import BoundTensor
from ..geometry.kronecker.basis import KroneckerBasis
from ..geometry.kronecker.binding import BoundKronecker
from ..geometry.kronecker.views import AnchorWeights
from ..ops import free_threshold
from ..parallel import local_tensor
from .memory import MemoryPlan
from .peft_adapters import AdaptedWeight
from .theta0 import Theta0Reader


@dataclass(eq=False)
class TrackedTensor:
    """One trainable parameter that some anchor covers, as this process holds it.

    `theta0` is this process's part of it at the path's origin (`MemoryPlan.snapshot`), `fisher` each covering
    anchor's F on that part (by anchor name, as `MemoryPlan.store_fisher` keeps it), `held` which elements of the
    full parameter they are, `sharded` whether other processes hold the rest (sums over it are added across
    processes)."""

    name: str
    param: torch.Tensor  # a Parameter, or a view into an FSDP1 flat shard
    theta0: torch.Tensor
    sharded: bool
    held: HeldRange
    fisher: dict[str, torch.Tensor]
    kfac: dict[str, KroneckerBasis] = field(default_factory=dict)  # anchor name -> this process's basis
    transposed: bool = False  # stores W^T (Conv1D): the K-FAC weight is the transpose

    def oriented(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (shaped like the parameter's local part) as the K-FAC weight's out x in view."""
        return tensor.T if self.transposed else tensor

    def local(self) -> torch.Tensor:
        """What this process holds and updates of the parameter now (`parallel.local_tensor`: resolved at each use)."""
        return local_tensor(self.param)

    def covered_by(self, anchors: Sequence[str]) -> bool:
        """Whether some of `anchors` covers this tensor with a diagonal F."""
        return any(name in self.fisher for name in anchors)

    def row(self, anchors: Sequence[str]) -> list[torch.Tensor | None]:
        """The F of each of `anchors` on this tensor, None where one does not cover it."""
        return [self.fisher.get(name) for name in anchors]


@dataclass(eq=False)
class AdaptedTensor:
    """One LoRA-adapted base weight that some anchor covers, and each covering anchor's F on it (float32, shaped
    like the base weight, on its factors' device)."""

    weight: AdaptedWeight
    fisher: dict[str, torch.Tensor]
    kfac: dict[str, KroneckerBasis] = field(default_factory=dict)  # K-FAC anchors: the base weight's basis


@dataclass(eq=False)
class AnchorView:
    """One anchor as its drift metrics see it: the tracked tensors it covers (in its binding's order), the
    LoRA-adapted weights it covers, and its free-drift threshold (from its full F, the same on every process)."""

    name: str
    tensors: list[TrackedTensor]
    adapted: list[AdaptedTensor]
    threshold: float
    kronecker: list[TrackedTensor] = field(default_factory=list)  # the tracked tensors it factors (K-FAC)

    @property
    def fisher(self) -> list[torch.Tensor]:
        """Its F on each of its tracked tensors (this process's parts)."""
        return [t.fisher[self.name] for t in self.tensors]


def track(
    bound: Mapping[str, list[BoundTensor]],
    memory: MemoryPlan,
    saved: Theta0Reader | None,
    kronecker: Mapping[str, list[BoundKronecker]] | None = None,
) -> list[TrackedTensor]:
    """Every parameter any anchor binds, once (under its first binding's name, in binding order: diagonal bindings,
    then K-FAC ones), with theta0 snapshot from the weights now, or read from `saved` (resuming, a refreshed
    state), each anchor's F, and each K-FAC anchor's basis."""
    kronecker = kronecker or {}
    first: dict[int, BoundTensor | BoundKronecker] = {}
    for tensors in bound.values():
        for t in tensors:
            first.setdefault(id(t.param), t)
    for factored in kronecker.values():
        for k in factored:
            first.setdefault(id(k.param), k)
    fisher: dict[int, dict[str, torch.Tensor]] = {key: {} for key in first}
    bases: dict[int, dict[str, KroneckerBasis]] = {key: {} for key in first}
    for anchor, tensors in bound.items():
        for t in tensors:
            fisher[id(t.param)][anchor] = t.fisher
    for anchor, factored in kronecker.items():
        for k in factored:
            bases[id(k.param)][anchor] = k.basis
    theta0 = saved.read([(t.name, t.held) for t in first.values()]) if saved is not None else {}
    return [
        TrackedTensor(
            t.name,
            t.param,
            memory.snapshot(local_tensor(t.param), theta0.get(t.name)),
            t.sharded,
            t.held,
            fisher[key],
            bases[key],
            getattr(t, "transposed", False),
        )
        for key, t in first.items()
    ]


def adapted_tensors(weights: Mapping[str, AdaptedWeight], anchors: Sequence[FisherAnchor]) -> list[AdaptedTensor]:
    """The LoRA-adapted weights (`PeftView.adapted`: base-model name -> weight) any anchor covers, each once, in the
    order the anchors cover them (the first anchor's first), with each covering anchor's F (float32, on the
    factors' device)."""
    covered: dict[str, AdaptedTensor] = {}
    for anchor in anchors:
        for name, weight in weights.items():
            if name in anchor.fisher:
                record = covered.setdefault(name, AdaptedTensor(weight, {}))
                record.fisher[anchor.name] = anchor.fisher[name].to(weight.device, torch.float32)
            elif name in anchor.kfac:
                record = covered.setdefault(name, AdaptedTensor(weight, {}))
                record.kfac[anchor.name] = anchor.kfac[name].placed(weight.device)
    return list(covered.values())


def anchor_views(
    anchors: Sequence[FisherAnchor],
    bound: Mapping[str, list[BoundTensor]],
    tracked: Sequence[TrackedTensor],
    adapted: Sequence[AdaptedTensor],
    free_fraction: float,
) -> dict[str, AnchorView]:
    """Each anchor's view, by name. Its threshold is the free_fraction order statistic of its full F over every
    covered parameter that can move (trainable and LoRA-adapted ones; `ops.free_threshold`), read one tensor at a
    time (an anchor kept in its files is never loaded whole); for a K-FAC anchor the values are the weights of its
    coordinates (`geometry.kronecker.views.AnchorWeights`: the eigenvalue of each coordinate of A_r (x) G_r);
    inf when it covers none."""
    by_param = {id(t.param): t for t in tracked}
    views = {}
    for anchor in anchors:
        names = [t.name for t in bound[anchor.name]]
        covered = [a for a in adapted if anchor.name in a.fisher or anchor.name in a.kfac]
        factored = [t for t in tracked if anchor.name in t.kfac]
        names += [a.weight.name for a in covered] + [t.name for t in factored]
        weights = AnchorWeights(anchor.fisher, anchor.kfac)
        threshold = free_threshold(TensorsOf(weights, names), free_fraction) if names else math.inf
        tensors = [by_param[id(t.param)] for t in bound[anchor.name]]
        views[anchor.name] = AnchorView(anchor.name, tensors, covered, threshold, factored)
    return views
