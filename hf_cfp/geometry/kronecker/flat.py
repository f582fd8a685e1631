"""The per-step state of K-FAC weights held as flat pieces (FSDP1, DeepSpeed ZeRO-3, and ZeRO's fp32 master
fragments, `master`): each weight a batch of one, projected from its piece with one all-reduce (`pieces`), every
process going through the same weights in the same order."""

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from ...parallel import all_reduce_sum_
from ..base import Tracked
from .basis import Projection
from .pieces import PieceRows, piece_drift_squares, project_piece, pull_piece_


class HeldPiece(Protocol):
    """What `FlatPieces` reads of a weight held as a flat piece: a tracked tensor (`base.Tracked`), or a fragment
    of DeepSpeed's fp32 master copy (`master`): theta0 of the piece, the elements of the weight it is
    (`binding.HeldRange`), each anchor's basis (U_G's rows for the rows the piece touches) and the piece now."""

    @property
    def theta0(self) -> torch.Tensor: ...

    @property
    def held(self) -> Any: ...

    @property
    def kfac(self) -> dict[str, Any]: ...

    def local(self) -> torch.Tensor: ...


class _Piece:
    """One weight held as a flat piece, a batch of one: its basis (U_G's rows for the rows the piece touches)."""

    def __init__(self, anchor: str, tensor: HeldPiece):
        self.tensors, self.basis = [tensor], tensor.kfac[anchor]
        in_dim = self.basis.a_vectors.shape[-2]
        self.piece, self.out_dim = PieceRows(tensor.held.start, tensor.held.stop, in_dim), tensor.held.numel // in_dim

    @torch.no_grad()
    def displacement(self) -> torch.Tensor:
        """theta - theta0 of the piece, laid into its rows (`pieces.PieceRows.laid_out`)."""
        t = self.tensors[0]
        return self.piece.laid_out(t.local() - t.theta0, self.basis.a_vectors.dtype)


class FlatPieces:
    """One anchor's K-FAC weights held as flat pieces (FSDP1, ZeRO-3, DeepSpeed's master fragments), every process
    going through the same weights in the same order (an empty piece takes part in each reduce with zeros)."""

    sharded, split = True, False

    def __init__(self, anchor: str, tensors: Sequence[HeldPiece]):
        self.anchor = anchor
        self.batches = [_Piece(anchor, t) for t in tensors]

    def rotated(self, batch: _Piece) -> Projection:
        """The complete projection of the weight's displacement now (`pieces.project_piece`, one all-reduce)."""
        return project_piece(batch.basis, batch.displacement(), batch.piece, batch.out_dim, all_reduce_sum_)

    def proposals(self) -> list[Projection]:
        """`rotated` of every weight."""
        return [self.rotated(b) for b in self.batches]

    @torch.no_grad()
    def pull_(self, lam: float, rotated: list[Projection] | None = None) -> None:
        """Every piece pulled in place (`pieces.pull_piece_`), projected here one weight at a time unless given."""
        for i, batch in enumerate(self.batches):
            t = batch.tensors[0]
            projection = rotated[i] if rotated is not None else self.rotated(batch)
            pull_piece_(t.local(), t.theta0, batch.basis, projection, batch.piece, lam)

    @torch.no_grad()
    def drift(self, threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(complete, local) `pieces.piece_drift_squares` over every weight."""
        b = self.batches
        return piece_drift_squares(
            [x.displacement() for x in b],
            [x.basis for x in b],
            [x.piece for x in b],
            [x.out_dim for x in b],
            threshold,
            all_reduce_sum_,
        )


def is_flat_piece(t: Tracked) -> bool:
    """Whether this process holds `t` as a flat piece (FSDP1, ZeRO-3): a 1-D run of the weight's elements."""
    return t.sharded and t.local().dim() == 1
