"""The Kronecker-factored (K-FAC) geometry of a Linear-like weight: its CFP correction and its drift (pure math).

For a weight W (out x in) an anchor keeps F_W ~ A (x) G through each factor's top eigenpairs and, when it keeps
fewer than all, one eigenvalue for the rest, the mean of what was dropped (the tail):

    A_r = U_A diag(alpha) U_A^T + rho_A (I - U_A U_A^T)     (U_A: in x r_A orthonormal, rho_A = 0 when r_A = in),

and the same for G (out x out) with U_G, gamma, rho_G. A_r (x) G_r has four blocks of eigen-directions, with the
eigenvalues gamma alpha^T (kept G x kept A), gamma rho_A (kept x tail), rho_G alpha (tail x kept) and rho_G rho_A
(tail x tail). With P = U_G^T D U_A, N = U_G^T D and M = D U_A for a displacement D, the blocks' coordinates are

    kept x kept: P,   kept x tail: N - P U_A^T,   tail x kept: M - U_G P,
    tail x tail: D - U_G N - M U_A^T + U_G P U_A^T,

and the quadratic is sum over the blocks of eigenvalue x squared coordinate. The CFP correction, the exact
proximal map of (lam / 2) tr(X^T G_r X A_r) at the proposal D = theta' - theta0, scales each block's coordinates
by 1 / (1 + lam eigenvalue); with the pulled shares w = lam e / (1 + lam e) of each block, it subtracts

    shrink = w_tt D + U_G [(w_kt - w_tt) N + ((w_kk - w_kt - w_tk + w_tt) P) U_A^T] + [(w_tk - w_tt) M] U_A^T

(w_kt broadcast down the rows, w_tk across the columns). It is applied as theta <- lerp(theta, theta0, w_tt) - L R
with L = [U_G, (w_tk - w_tt) M] and R = [(w_kt - w_tt) N + (...) U_A^T ; U_A^T] (`shrink_factors`), the product
added into the weight without being formed: with the projection's two products, 4 out x in x r multiply-adds and
no copy of D. Without a tail (rho = 0: full factors, or a truncation that treats the rest as free) only the kept
block pulls, shrink = U_G [w_kk P] U_A^T, and that is what is computed.

Under row sharding (FSDP2 splits W along its first dimension) a process holds rows of W, of D and of U_G: M is
complete for its rows, P and N are partial sums over them, completed by `reduce` (an all-reduce across processes)
together with the column norms of M and |D|^2 that the tail's drift needs (r_G (r_A + in) + r_A + 1 floats).

A basis may carry a leading batch dimension (the bases of n weights of one shape stacked, `protection.kronecker`):
every function below then works on the stacked weights (n x out x in) at once, by batched matrix products. The
rotations multiply in the eigenvectors' dtype (bfloat16 bases for bfloat16 weights: the products' rounding, 2^-8
of the rotated displacement, is at or below the weights' own), everything else in float32.
"""

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

# Completes a list of partial sums in place (an all-reduce under row sharding; nothing on one process).
Reduce = Callable[[list[torch.Tensor]], None]


def _no_reduce(tensors: list[torch.Tensor]) -> None:
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
        """The bases of n weights of one shape as one basis with a leading batch dimension (tails of 0 for those
        without one, when some has one)."""
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
        """The i-th basis of a stacked one (views)."""
        return self._map(lambda t: t[i], lambda t: t[i])

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
        """U_G^T Delta U_A (a partial sum over the rows held here), multiplied in the eigenvectors' dtype, float32."""
        d = delta.to(self.a_vectors.dtype)
        return (self.g_vectors.transpose(-2, -1) @ (d @ self.a_vectors)).float()

    def project(self, delta: torch.Tensor) -> "Projection":
        """Delta's coordinates in the blocks (module docstring), partial sums over the rows held here."""
        if not self.tailed:
            return Projection(self.rotate(delta))
        d = delta.to(self.a_vectors.dtype)
        columns = d @ self.a_vectors  # M = D U_A, the rows held here
        kept = (self.g_vectors.transpose(-2, -1) @ columns).float()
        rows = (self.g_vectors.transpose(-2, -1) @ d).float()  # N = U_G^T D
        total = torch.linalg.vector_norm(delta.float(), dim=(-2, -1)).double().square()  # faster than dtype=
        norms = torch.cat([columns.float().square().sum(-2, dtype=torch.float64), total[..., None]], dim=-1)
        return Projection(kept, rows, columns.float(), norms)


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
    displacements: Iterable[torch.Tensor], bases: Sequence[KroneckerBasis], reduce: Reduce = _no_reduce
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
    reduce: Reduce = _no_reduce,
) -> list[Projection]:
    """The projections of theta_k - theta0_k for every weight, complete (`projected`, one D_k at a time)."""
    return projected((p - t for p, t in zip(params, theta0, strict=True)), bases, reduce)


def pulled_share(weights: torch.Tensor, lam: float) -> torch.Tensor:
    """w = lam e / (1 + lam e) of eigenvalues e: the share of each coordinate pulled back."""
    strength = weights.mul(float(lam))
    return strength.div_(strength + 1.0)


def shrink_factors(
    basis: KroneckerBasis, projection: Projection, lam: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(L, R, w_tt) with shrink = L R + w_tt D: `block_factors` with the pulled shares w = lam e / (1 + lam e)."""
    return block_factors(basis, projection, [pulled_share(w, lam) for w in basis.block_weights()])


def block_factors(
    basis: KroneckerBasis, projection: Projection, scales: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(L, R, s_tt) with L R + s_tt D = the sum over the blocks of s_b x D's component in block b, for one scale
    s_b per block (shaped like `KroneckerBasis.block_weights`), in the eigenvectors' dtype, the rows held here:
    L = [U_G, (s_tk - s_tt) M] (rows x (r_G + r_A)), R = [(s_kt - s_tt) N + (core P) U_A^T ; U_A^T] with
    core = s_kk - s_kt - s_tk + s_tt; without a tail L = U_G (s_kk P) (rows x r_A), R = U_A^T and s_tt None.
    With s = w it is the correction's shrink (`shrink_factors`); with s = lam e it is lam (G_r (x) A_r) vec(D)."""
    dtype, a_t = basis.a_vectors.dtype, basis.a_vectors.transpose(-2, -1)
    if not basis.tailed:
        return basis.g_vectors @ (projection.kept * scales[0]).to(dtype), a_t, None
    assert projection.rows is not None and projection.columns is not None
    kk, kt, tk, tt = scales
    kt, tk = kt - tt.unsqueeze(-1), tk - tt.unsqueeze(-1)
    core = (kk - kt.unsqueeze(-1) - tk.unsqueeze(-2) - tt[..., None, None]) * projection.kept
    rows = (kt.unsqueeze(-1) * projection.rows).to(dtype) + core.to(dtype) @ a_t
    columns = (tk.unsqueeze(-2) * projection.columns).to(dtype)
    return torch.cat([basis.g_vectors, columns], dim=-1), torch.cat([rows, a_t], dim=-2), tt


def subtract_shrink_(
    param: torch.Tensor,
    start: torch.Tensor | None,
    left: torch.Tensor,
    right: torch.Tensor,
    tail_share: torch.Tensor | None,
) -> None:
    """In place: theta <- theta - (L R + w_tt (theta - theta0)) = lerp(theta, theta0, w_tt) - L R
    (`shrink_factors`; one weight or one stack), in float32, rounded once to the parameter's dtype; the product
    is added into the weights without being formed when its dtype is theirs."""
    work = param.float()  # the parameter itself when it is float32
    if tail_share is not None:
        assert start is not None, "a basis with a tail pulls toward theta0: pass it"
        work.lerp_(start.float(), tail_share[..., None, None])
    if left.dtype == work.dtype:
        (work.baddbmm_ if work.dim() == 3 else work.addmm_)(left, right, alpha=-1)
    else:
        work.sub_((left @ right).float())
    if work is not param:
        param.copy_(work)


def kfac_pull_(
    params: Sequence[torch.Tensor],
    theta0: Sequence[torch.Tensor] | None,
    bases: Sequence[KroneckerBasis],
    lam: float,
    rotated: Sequence[Projection] | None = None,
    reduce: Reduce = _no_reduce,
) -> None:
    """In place, on every weight: theta <- theta - shrink, the exact proximal map of (lam / 2) tr(X^T G_r X A_r)
    at D = theta - theta0 (`shrink_factors`, `subtract_shrink_`). `rotated`: the projections of these proposals
    already computed (the KL budget's solve computes them first); by default computed here. `theta0` is read to
    form them, and with a tail for the pull of the tail x tail block. Temporaries: the displacement of one weight
    (of one stack of weights), and less than it with a float32 weight."""
    if lam == 0:
        return
    with torch.no_grad():
        if rotated is None:
            assert theta0 is not None, "kfac_pull_ needs theta0 or the rotated proposals"
            rotated = rotated_displacements(params, theta0, bases, reduce)
        for k, (param, basis, projection) in enumerate(zip(params, bases, rotated, strict=True)):
            left, right, tail_share = shrink_factors(basis, projection, lam)
            subtract_shrink_(param, theta0[k] if theta0 is not None else None, left, right, tail_share)


def kfac_drift_squares(
    displacements: Sequence[torch.Tensor],
    bases: Sequence[KroneckerBasis],
    threshold: float,
    reduce: Reduce = _no_reduce,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The drift of K-FAC weights (their displacements D = theta - theta0, the rows held here) in their blocks of
    eigen-directions, as float64 sums on the CPU:

    (complete [sum e s, -(sum of s over e > threshold)], local [sum D^2])

    over the blocks' eigenvalues e and squared coordinates s (`KroneckerBasis.block_weights`,
    `Projection.squares`). The first pair is complete on every process (from the reduced projections); the local
    sum runs over the rows held here and must be added across processes. The free drift^2 over these weights, the
    squared coordinates whose eigenvalue is <= threshold, is then complete[1] + sum D^2: the blocks split
    |D|^2, and the coordinates outside a basis without a tail have eigenvalue 0."""
    projections = projected(displacements, bases, reduce)
    sums = []  # summed on the device, moved to the CPU once
    with torch.no_grad():
        for delta, basis, projection in zip(displacements, bases, projections, strict=True):
            sensitive = above = torch.zeros((), dtype=torch.float64, device=projection.kept.device)
            for weights, squares in zip(basis.block_weights(), projection.squares(), strict=True):
                sensitive = sensitive + torch.mul(squares, weights).sum(dtype=torch.float64)
                above = above + torch.where(weights > threshold, squares, 0.0).sum(dtype=torch.float64)
            local = torch.linalg.vector_norm(delta.float()).double().square()
            sums.append(torch.stack([sensitive, -above, local]))
    total = torch.stack(sums).sum(0).cpu() if sums else torch.zeros(3, dtype=torch.float64)
    return total[:2], total[2:]


def kfac_budget_terms(rotated: Sequence[Projection], bases: Sequence[KroneckerBasis], lam: float) -> torch.Tensor:
    """[KL, dKL / dlam] (float64 [2], CPU) of the K-FAC weights for the proposals' projections (the KL budget's
    solve, `ops.budget`): over the blocks' eigenvalues e and the proposal's squared coordinates s,

        KL = 0.5 sum e s / (1 + lam e)^2,      dKL / dlam = - sum e^2 s / (1 + lam e)^3,

    the predicted KL after the correction `kfac_pull_` would make with this lam (it scales each block's
    coordinates by 1 / (1 + lam e))."""
    terms = []  # summed on the device, moved to the CPU once
    with torch.no_grad():
        for projection, basis in zip(rotated, bases, strict=True):
            for weights, squares in zip(basis.block_weights(), projection.squares(), strict=True):
                relief = weights.mul(float(lam)).add_(1.0)
                weighted = squares.mul(weights).div_(relief.square())  # e s / (1 + lam e)^2
                kl = 0.5 * weighted.sum(dtype=torch.float64)
                slope = -weighted.mul_(weights).div_(relief).sum(dtype=torch.float64)
                terms.append(torch.stack([kl, slope]))
    return torch.stack(terms).sum(0).cpu() if terms else torch.zeros(2, dtype=torch.float64)
