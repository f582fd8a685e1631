"""The path from theta0, which belongs to no geometry: the origin theta0 of every tracked parameter (this process's
part of it) and the total drift ||theta - theta0|| over them (`cfp/total_drift`), whatever structure of F covers
them, or several.

`Path` is composed by `CFPState` beside the geometries' states (`geometry.base.GeometryState`): it corrects nothing
and has no KL-budget terms or pull strengths; its drift sums carry the total alone (at 0 of the metric order of
`names.drift_keys`), in two parts (replicated, sharded) like every state's.
"""

from collections.abc import Sequence

import torch

from ..geometry.base import Tracked
from ..ops import drift_squares


class Path:
    """theta0 and the total drift of the tracked tensors.

    Args:
        tensors: every tracked tensor (`records.TrackedTensor`), in order.
        anchors: how many anchors the metrics run over (V: the drift sums are float64 [1 + 2V]).
    """

    def __init__(self, tensors: Sequence[Tracked], anchors: int):
        self.tensors, self.size = list(tensors), 1 + 2 * anchors
        self.replicated = [t for t in self.tensors if not t.sharded]
        self.sharded = [t for t in self.tensors if t.sharded]

    @property
    def theta0(self) -> list[torch.Tensor]:
        """theta0 of each tracked tensor (this process's part), in order."""
        return [t.theta0 for t in self.tensors]

    def _total(self, tensors: list[Tracked]) -> torch.Tensor:
        """float64 [1 + 2V]: sum Delta^2 over `tensors` at 0 (`ops.drift.drift_squares`, detached), nothing else."""
        sums = torch.zeros(self.size, dtype=torch.float64)
        sums[0] = drift_squares([t.local().detach() for t in tensors], [t.theta0 for t in tensors], [])[0]
        return sums

    def drift_squares(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(replicated, sharded) sums of (theta - theta0)^2, each float64 [1 + 2V] on the CPU, the total at 0."""
        return self._total(self.replicated), self._total(self.sharded)

    def correct(self, lams: Sequence[float]) -> None:
        """Nothing: the path is what the geometries correct."""

    def budget_terms(self, lams: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor]:
        """No terms: float64 zeros [2, K]."""
        zeros = torch.zeros(2, len(lams), dtype=torch.float64)
        return zeros, zeros.clone()

    def strengths(self, lams: Sequence[float]) -> Sequence[torch.Tensor]:
        """No pull."""
        return []

    def kept(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(theta0 of every tracked tensor, nothing offloaded beside it)."""
        return self.theta0, []

    @property
    def shard_device(self) -> torch.device | None:
        """The device the sharded sums are all-reduced on (the first sharded tensor's), None with none."""
        return self.sharded[0].local().device if self.sharded else None
