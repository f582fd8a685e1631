"""A K-FAC weight held as a flat piece: elements [start, stop) of the row-major flattened out x in weight W, cut
anywhere, as FSDP1 (both `use_orig_params`), DeepSpeed ZeRO-3 partitions and ZeRO-1/2's fp32 master fragments
hold it (pure math).

The piece is laid into the rows it touches (`PieceRows`: rows r0..r1 of W, zeros outside the piece), and the
row-sharded math of `basis` and `proximal` runs on those rows with one change. The projections of a displacement D
are bilinear in D, so sums over disjoint pieces add up: P = U_G^T D U_A and N = U_G^T D are partial sums, completed
by the reduce as under row sharding; but M = D U_A is complete only on the rows a process holds whole, so the full
out x r_A M (zeros outside the process's rows) is reduced with them, and the column norms |M_:j|^2 the tail's drift
needs are taken from the complete M after the reduce. Each process then corrects exactly the elements it holds, from
its rows of U_G and of M, with N, P and U_A (`proximal.pull_` on the laid-out rows; only the piece is written back).

What crosses processes per weight and projection: r_G r_A + r_G in + out r_A + 1 floats with a tail (the
kept block alone, r_G r_A, without one).
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .basis import KroneckerBasis, Projection, Reduce, widened
from .proximal import projection_drift_squares, shrink_factors, subtract_shrink_


@dataclass(frozen=True)
class PieceRows:
    """Elements [start, stop) of the row-major flattening of a weight `in_dim` wide, and the rows they touch."""

    start: int
    stop: int
    in_dim: int

    @property
    def rows(self) -> slice:
        """The rows of W the piece touches (empty for an empty piece)."""
        if self.stop <= self.start:
            return slice(0, 0)
        return slice(self.start // self.in_dim, -(-self.stop // self.in_dim))

    def laid_out(self, flat: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The piece (1-D, stop - start elements) in its rows (rows x in_dim), zeros elsewhere, in `dtype`."""
        rows = self.rows
        block = flat.new_zeros((rows.stop - rows.start, self.in_dim), dtype=dtype or flat.dtype)
        offset = self.start - rows.start * self.in_dim
        block.view(-1)[offset : offset + flat.numel()] = flat
        return block

    def write_back_(self, flat: torch.Tensor, block: torch.Tensor) -> None:
        """flat <- the piece's elements of the laid-out `block`, rounded once to flat's dtype."""
        offset = self.start - self.rows.start * self.in_dim
        flat.copy_(block.reshape(-1)[offset : offset + flat.numel()])


def project_piece(
    basis: KroneckerBasis, delta: torch.Tensor, piece: PieceRows, out_dim: int, reduce: Reduce
) -> Projection:
    """The projection (`basis.Projection`) of the displacement D of a whole weight from this process's piece of it,
    complete after `reduce` (module docstring): `delta` is the piece laid out (`PieceRows.laid_out`), `basis` holds
    U_G's rows for `piece.rows`; the projection's M is those rows of the complete M."""
    if not basis.tailed:
        kept = basis.rotate(delta)
        reduce([kept])
        return Projection(kept)
    d = delta.to(basis.a_vectors.dtype)
    columns = d @ basis.a_vectors
    complete = columns.new_zeros((out_dim, columns.shape[-1]), dtype=widened(columns).dtype)
    complete[piece.rows] = columns
    kept = widened(basis.g_vectors.transpose(-2, -1) @ columns)
    rows = widened(basis.g_vectors.transpose(-2, -1) @ d)
    total = torch.linalg.vector_norm(widened(delta)).double().square().reshape(1)
    reduce([kept, rows, complete, total])
    norms = torch.cat([complete.square().sum(-2, dtype=torch.float64), total])
    return Projection(kept, rows, complete[piece.rows], norms)


def pull_piece_(
    flat: torch.Tensor,
    start: torch.Tensor,
    basis: KroneckerBasis,
    projection: Projection,
    piece: PieceRows,
    lam: float,
) -> None:
    """In place: the piece `flat` (its theta0 piece `start`) <- theta - shrink (`proximal.shrink_factors`) from
    the weight's complete projection (`project_piece`), on the laid-out rows in float32, rounded once to flat's
    dtype."""
    left, right, tail_share = shrink_factors(basis, projection, lam)
    block = piece.laid_out(flat, torch.float32)
    origin = piece.laid_out(start, torch.float32) if tail_share is not None else None
    subtract_shrink_(block, origin, left, right, tail_share)
    piece.write_back_(flat, block)


def piece_drift_squares(
    deltas: Sequence[torch.Tensor],
    bases: Sequence[KroneckerBasis],
    pieces: Sequence[PieceRows],
    out_dims: Sequence[int],
    threshold: float,
    reduce: Reduce,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`proximal.kfac_drift_squares` of weights held as pieces (`deltas` laid out), one reduce per weight."""
    projections = [
        project_piece(basis, delta, piece, out_dim, reduce)
        for delta, basis, piece, out_dim in zip(deltas, bases, pieces, out_dims, strict=True)
    ]
    return projection_drift_squares(deltas, bases, projections, threshold)
