"""The protocol `CFPState` composes its geometries through: one per structure of F (a diagonal,
`diagonal.DiagonalTensors`; Kronecker factors, `kronecker.KroneckerTensors`), each owning its tensors' correction,
drift sums, KL-budget terms, pull strengths and what it keeps in memory.

Sums come in two parts: over tensors every process holds whole (replicated: counted once) and over tensors whose
pieces are spread over processes (sharded: added across processes). `CFPState` adds every geometry's parts and
makes one collective of the sharded ones (`complete`).
"""

from collections.abc import Sequence
from typing import Protocol

import torch

from ..parallel import all_reduce_sum_


class Geometry(Protocol):
    """One structure of F over the tensors it was bound to."""

    def correct(self, lams: Sequence[float]) -> None:
        """The CFP correction of its protected tensors with each protecting anchor's lam, in place."""
        ...

    def drift_squares(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(replicated, sharded) float64 [1 + 2V] on the CPU in the metric order of `names.drift_keys`: at 0 the
        total drift's sum of squares, at 1 + 2v and 2 + 2v anchor v's sensitive and free ones."""
        ...

    def budget_terms(self, lams: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor]:
        """(replicated, sharded) [KL_k, dKL_k / dlam_k] of its protected tensors, float64 [2, K] on the CPU."""
        ...

    def strengths(self, lams: Sequence[float]) -> Sequence[torch.Tensor]:
        """The pull lam e of every protected coordinate (e its eigenvalue in F), a tensor at a time."""
        ...

    def kept(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(the tensors it keeps beside the parameters, those it keeps offloaded)."""
        ...

    @property
    def shard_device(self) -> torch.device | None:
        """The device its sharded sums are all-reduced on; None when it holds nothing sharded."""
        ...


def complete(geometries: Sequence[Geometry], parts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The sum over `parts` (each geometry's (replicated, sharded) sums, in order) with the sharded ones added
    across processes: one all-reduce, on the first shard device (none when nothing is sharded)."""
    replicated = sum((r for r, _ in parts), torch.zeros_like(parts[0][0]))
    sharded = sum((s for _, s in parts), torch.zeros_like(parts[0][1]))
    device = next((g.shard_device for g in geometries if g.shard_device is not None), None)
    if device is not None:
        sharded = sharded.to(device)
        all_reduce_sum_([sharded])
    return replicated + sharded.cpu()
