"""The Kronecker-factored (K-FAC) geometry of a Linear-like weight: its eigenbasis and a displacement's coordinates in
it (pure math).

For a weight W (out x in) an anchor keeps F_W ~ A (x) G through each factor's top eigenpairs and, when it keeps
fewer than all, one eigenvalue for the rest, the mean of what was dropped (the tail):

    A_r = U_A diag(alpha) U_A^T + rho_A (I - U_A U_A^T)     (U_A: in x r_A orthonormal, rho_A = 0 when r_A = in),

and the same for G (out x out) with U_G, gamma, rho_G. A_r (x) G_r has four blocks of eigen-directions, with the
eigenvalues gamma alpha^T (kept G x kept A), gamma rho_A (kept x tail), rho_G alpha (tail x kept) and rho_G rho_A
(tail x tail). With P = U_G^T D U_A, N = U_G^T D and M = D U_A for a displacement D, the blocks' coordinates are

    kept x kept: P,   kept x tail: N - P U_A^T,   tail x kept: M - U_G P,
    tail x tail: D - U_G N - M U_A^T + U_G P U_A^T,

and the quadratic is sum over the blocks of eigenvalue x squared coordinate (`Projection.squares`,
`KroneckerBasis.block_weights`); the correction, drift and budget terms computed from them are `proximal`'s.

Under row sharding (FSDP2 splits W along its first dimension) a process holds rows of W, of D and of U_G: M is
complete for its rows, P and N are partial sums over them, completed by `reduce` (an all-reduce across processes)
together with the column norms of M and |D|^2 that the tail's drift needs (r_G (r_A + in) + r_A + 1 floats).

A basis may carry a leading batch dimension (the bases of n weights of one shape stacked):
every function below then works on the stacked weights (n x out x in) at once, by batched matrix products. The
rotations multiply in the eigenvectors' dtype (bfloat16 bases for bfloat16 weights: the products' rounding, 2^-8
of the rotated displacement, is at or below the weights' own), everything else in float32.
"""

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

# Completes a list of partial sums in place (an all-reduce under row sharding; nothing on one process).
Reduce = Callable[[list[torch.Tensor]], None]


def no_reduce(tensors: list[torch.Tensor]) -> None:
    """One process holds every row: the sums are already complete."""


@dataclass(frozen=True)
class KroneckerBasis:
    """The kept eigenpairs and tails of one weight's factors, float32, on the weight's device.

    Args:
        a_vectors: U_A, in x r_A, orthonormal columns (the input factor's top eigenvectors); optionally stacked,
            n x in x r_A, as every part then.
        a_values: alpha, r_A, >= 0.
        g_vectors: U_G, rows x r_G, the rows of the output factor's top eigenvectors for the rows of W held here
            (all of them on one process).
        g_values: gamma, r_G, >= 0.
        a_tail: rho_A, the eigenvalue of every direction outside U_A (a 0-dim tensor; (n,) stacked); None: 0.
        g_tail: rho_G, the same for G; None: 0. A basis with both None has no tail.
    """

    a_vectors: torch.Tensor
    a_values: torch.Tensor
    g_vectors: torch.Tensor
    g_values: torch.Tensor
    a_tail: torch.Tensor | None = None
    g_tail: torch.Tensor | None = None

    def placed(self, device: torch.device | str, vectors_dtype: torch.dtype = torch.float32) -> "KroneckerBasis":
        """This basis on `device`, eigenvectors in `vectors_dtype`, eigenvalues and tails float32, contiguous."""
        return self._map(
            lambda t: t.to(device, vectors_dtype).contiguous(), lambda t: t.to(device, torch.float32).contiguous()
        )

    @staticmethod
    def stacked(bases: Sequence["KroneckerBasis"]) -> "KroneckerBasis":
        """n bases of one shape as one with a leading batch dimension (0 tails for those without, if some has)."""
        tails = [b.tails() for b in bases] if any(b.tailed for b in bases) else None
        return KroneckerBasis(
            torch.stack([b.a_vectors for b in bases]),
            torch.stack([b.a_values for b in bases]),
            torch.stack([b.g_vectors for b in bases]),
            torch.stack([b.g_values for b in bases]),
            None if tails is None else torch.stack([a for a, _ in tails]),
            None if tails is None else torch.stack([g for _, g in tails]),
        )

    def __getitem__(self, i: int) -> "KroneckerBasis":
        return self._map(lambda t: t[i], lambda t: t[i])  # the i-th basis of a stacked one (views)

    def _map(
        self, vectors: Callable[[torch.Tensor], torch.Tensor], values: Callable[[torch.Tensor], torch.Tensor]
    ) -> "KroneckerBasis":
        """The basis with `vectors` applied to U_A and U_G, `values` to the eigenvalues and the tails."""
        a_tail, g_tail = (None if t is None else values(t) for t in (self.a_tail, self.g_tail))
        return KroneckerBasis(
            vectors(self.a_vectors),
            values(self.a_values),
            vectors(self.g_vectors),
            values(self.g_values),
            a_tail,
            g_tail,
        )

    @property
    def tailed(self) -> bool:
        """Whether some factor gives the directions outside its kept eigenvectors a (possibly nonzero) eigenvalue."""
        return self.a_tail is not None or self.g_tail is not None

    def tails(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(rho_A, rho_G), float32 tensors shaped like the batch (0 for a factor without a tail)."""
        zero = self.a_values.new_zeros(self.a_values.shape[:-1], dtype=torch.float32)
        return tuple(zero if t is None else t.float() for t in (self.a_tail, self.g_tail))  # type: ignore[return-value]

    def products(self) -> torch.Tensor:
        """gamma_i alpha_j, r_G x r_A (float32): the quadratic's eigenvalues on the kept x kept block."""
        return self.g_values.float().unsqueeze(-1) * self.a_values.float().unsqueeze(-2)

    def block_weights(self) -> list[torch.Tensor]:
        """The quadratic's eigenvalue of each block of eigen-directions, float32, shaped like `Projection.squares`:
        [gamma alpha^T (r_G x r_A), gamma rho_A (r_G), rho_G alpha (r_A), rho_G rho_A ()], the first alone
        without a tail."""
        if not self.tailed:
            return [self.products()]
        rho_a, rho_g = self.tails()
        gamma, alpha = self.g_values.float(), self.a_values.float()
        return [self.products(), gamma * rho_a.unsqueeze(-1), rho_g.unsqueeze(-1) * alpha, rho_g * rho_a]

    def coordinate_weights(self, out_dim: int, in_dim: int) -> torch.Tensor:
        """Every coordinate's eigenvalue in the quadratic of one out x in weight (unbatched), flat, float32: the
        blocks' eigenvalues each repeated as often as the block has coordinates (1, in - r_A, out - r_G and
        (out - r_G)(in - r_A)); without a tail, the kept block then out x in - r_G r_A zeros."""
        r_g, r_a = self.g_values.shape[-1], self.a_values.shape[-1]
        blocks = self.block_weights()
        if not self.tailed:
            kept = blocks[0].reshape(-1)
            return torch.cat([kept, kept.new_zeros(out_dim * in_dim - kept.numel())])
        counts = (1, in_dim - r_a, out_dim - r_g, (out_dim - r_g) * (in_dim - r_a))
        return torch.cat([b.reshape(-1).repeat_interleave(c) for b, c in zip(blocks, counts, strict=True)])

    def rotate(self, delta: torch.Tensor) -> torch.Tensor:
        """U_G^T Delta U_A (partial over the rows held here) in the eigenvectors' dtype, float32 (or float64)."""
        d = delta.to(self.a_vectors.dtype)
        return widened(self.g_vectors.transpose(-2, -1) @ (d @ self.a_vectors))

    def project(self, delta: torch.Tensor) -> "Projection":
        """Delta's coordinates in the blocks (module docstring), partial sums over the rows held here."""
        if not self.tailed:
            return Projection(self.rotate(delta))
        d = delta.to(self.a_vectors.dtype)
        columns = d @ self.a_vectors  # M = D U_A, the rows held here
        kept = widened(self.g_vectors.transpose(-2, -1) @ columns)
        rows = widened(self.g_vectors.transpose(-2, -1) @ d)  # N = U_G^T D
        total = torch.linalg.vector_norm(widened(delta), dim=(-2, -1)).double().square()  # faster than dtype=
        norms = torch.cat([widened(columns).square().sum(-2, dtype=torch.float64), total[..., None]], dim=-1)
        return Projection(kept, rows, widened(columns), norms)


def widened(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float64 else t.float()  # the projections' dtype: float32, float64 kept


@dataclass
class Projection:
    """A displacement D in a basis's blocks of eigen-directions.

    Args:
        kept: P = U_G^T D U_A (r_G x r_A).
        rows: N = U_G^T D (r_G x in); None without a tail.
        columns: M = D U_A (the rows held here x r_A); None without a tail.
        norms: [|M_:1|^2, ..., |M_:r_A|^2, |D|^2] (r_A + 1, float64); None without a tail.
    """

    kept: torch.Tensor
    rows: torch.Tensor | None = None
    columns: torch.Tensor | None = None
    norms: torch.Tensor | None = None

    def partials(self) -> list[torch.Tensor]:
        """What a reduce across row shards completes: P, and with a tail N and the norms."""
        return [self.kept] if self.rows is None else [self.kept, self.rows, self.norms]  # type: ignore[list-item]

    def squares(self) -> list[torch.Tensor]:
        """The squared coordinates of each block, summed where they share an eigenvalue (shaped like
        `KroneckerBasis.block_weights`): [P^2, |N_i|^2 - |P_i|^2, |M_:j|^2 - |P_:j|^2, |D|^2 - |N|^2 - |M|^2 + |P|^2]
        (the last three clamped at 0 against rounding); [P^2] without a tail."""
        kept = self.kept.square()
        if self.rows is None:
            return [kept]
        assert self.norms is not None
        row_sums, column_sums = self.rows.square().sum(-1), self.norms[..., :-1]
        kept_rows, kept_columns = kept.sum(-1), kept.sum(-2)
        corner = self.norms[..., -1] - row_sums.sum(-1) - column_sums.sum(-1) + kept_rows.sum(-1)
        return [
            kept,
            (row_sums - kept_rows).clamp(min=0),
            (column_sums - kept_columns).clamp(min=0),
            corner.clamp(min=0),
        ]


def projected(
    displacements: Iterable[torch.Tensor], bases: Sequence[KroneckerBasis], reduce: Reduce = no_reduce
) -> list[Projection]:
    """The projections of the displacements D_k (the rows held here) onto their bases, complete (one `reduce` for
    all); each D_k is read once, so an iterator holds one at a time."""
    with torch.no_grad():
        projections = [basis.project(delta) for delta, basis in zip(displacements, bases, strict=True)]
    reduce([t for projection in projections for t in projection.partials()])
    return projections


def rotated_displacements(
    params: Sequence[torch.Tensor],
    theta0: Sequence[torch.Tensor],
    bases: Sequence[KroneckerBasis],
    reduce: Reduce = no_reduce,
) -> list[Projection]:
    """The projections of theta_k - theta0_k for every weight, complete (`projected`, one D_k at a time)."""
    return projected((p - t for p, t in zip(params, theta0, strict=True)), bases, reduce)
