"""The Kronecker geometry's CFP correction, drift and KL-budget terms in a basis's blocks (`basis`; pure math).

The CFP correction, the exact proximal map of (lam / 2) tr(X^T G_r X A_r) at the proposal D = theta' - theta0,
scales each block's coordinates by 1 / (1 + lam eigenvalue); with the pulled shares w = lam e / (1 + lam e) of each
block, it subtracts

    shrink = w_tt D + U_G [(w_kt - w_tt) N + ((w_kk - w_kt - w_tk + w_tt) P) U_A^T] + [(w_tk - w_tt) M] U_A^T

(w_kt broadcast down the rows, w_tk across the columns). It is applied as theta <- lerp(theta, theta0, w_tt) - L R
with L = [U_G, (w_tk - w_tt) M] and R = [(w_kt - w_tt) N + (...) U_A^T ; U_A^T] (`shrink_factors`), the product
added into the weight without being formed: with the projection's two products, 4 out x in x r multiply-adds and
no copy of D. Without a tail (rho = 0: full factors, or a truncation that treats the rest as free) only the kept
block pulls, shrink = U_G [w_kk P] U_A^T, and that is what is computed.

Every function takes bases stacked or not, and partial projections completed by `reduce` under row sharding
(`basis.projected`).
"""

from collections.abc import Sequence

import torch

from .basis import KroneckerBasis, Projection, Reduce, no_reduce, projected, rotated_displacements


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


def pull_(
    targets: Sequence[torch.Tensor],
    starts: Sequence[torch.Tensor | None],
    basis: KroneckerBasis,
    projection: Projection,
    lam: float,
) -> None:
    """In place: theta <- theta - shrink (`shrink_factors`, `subtract_shrink_`) for the weights of one basis, from
    their projected proposal: `targets` is the weight (or a stack of weights) the basis describes, or the n weights
    of a stacked basis one by one (each pulled by its slice); `starts` their theta0 (read with a tail only)."""
    left, right, tail_share = shrink_factors(basis, projection, lam)
    if targets[0].dim() == left.dim():  # the weight, or the stack, of this basis
        subtract_shrink_(targets[0], starts[0], left, right, tail_share)
        return
    for j, (target, start) in enumerate(zip(targets, starts, strict=True)):
        subtract_shrink_(target, start, left[j], right[j], None if tail_share is None else tail_share[j])


def kfac_pull_(
    params: Sequence[torch.Tensor],
    theta0: Sequence[torch.Tensor] | None,
    bases: Sequence[KroneckerBasis],
    lam: float,
    rotated: Sequence[Projection] | None = None,
    reduce: Reduce = no_reduce,
) -> None:
    """In place, on every weight: theta <- theta - shrink, the exact proximal map of (lam / 2) tr(X^T G_r X A_r)
    at D = theta - theta0 (`pull_`). `rotated`: the projections of these proposals already computed (the KL
    budget's solve computes them first); by default computed here. `theta0` is read to form them, and with a tail
    for the pull of the tail x tail block. Temporaries: the displacement of one weight (of one stack of weights),
    and less than it with a float32 weight."""
    if lam == 0:
        return
    with torch.no_grad():
        if rotated is None:
            assert theta0 is not None, "kfac_pull_ needs theta0 or the rotated proposals"
            rotated = rotated_displacements(params, theta0, bases, reduce)
        for k, (param, basis, projection) in enumerate(zip(params, bases, rotated, strict=True)):
            pull_([param], [theta0[k] if theta0 is not None else None], basis, projection, lam)


def kfac_drift_squares(
    displacements: Sequence[torch.Tensor],
    bases: Sequence[KroneckerBasis],
    threshold: float,
    reduce: Reduce = no_reduce,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The drift of K-FAC weights (their displacements D = theta - theta0, the rows held here) in their blocks of
    eigen-directions (`projection_drift_squares` of their projections, completed by one `reduce`)."""
    return projection_drift_squares(displacements, bases, projected(displacements, bases, reduce), threshold)


def projection_drift_squares(
    displacements: Sequence[torch.Tensor],
    bases: Sequence[KroneckerBasis],
    projections: Sequence[Projection],
    threshold: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The drift of K-FAC weights from their displacements D (what is held here) and their complete projections,
    as float64 sums on the CPU:

    (complete [sum e s, -(sum of s over e > threshold)], local [sum D^2])

    over the blocks' eigenvalues e and squared coordinates s (`KroneckerBasis.block_weights`,
    `Projection.squares`). The first pair is complete on every process (from the reduced projections); the local
    sum runs over what is held here and must be added across processes. The free drift^2 over these weights, the
    squared coordinates whose eigenvalue is <= threshold, is then complete[1] + sum D^2: the blocks split
    |D|^2, and the coordinates outside a basis without a tail have eigenvalue 0."""
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
