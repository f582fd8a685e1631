"""The summed proximal map of K-FAC terms alone on one weight, split into the blocks of their pooled eigenvectors.

Each factor is X_r = rho I + U diag(v - rho) U^T (`basis`), so every G_k acts within Q_L, an orthonormal basis of
span[U_G,1, ..., U_G,K] (m_L <= sum_k r_G,k columns), and as rho_G,k on its complement; every A_k likewise with Q_R.
In the bases [Q_L, Q_L^perp] and [Q_R, Q_R^perp] the system (I + sum_k lam_k G_k (x) A_k) vec(X) = vec(D) falls
into four independent blocks, with G^_k = Q_L^T G_k Q_L = rho_G,k I + C_k diag(v_k - rho_G,k) C_k^T, C_k = Q_L^T
U_G,k (m_L x m_L), and A^_k alike:

    perp x perp:  X = D / (1 + sum_k lam_k rho_G,k rho_A,k)
    L x perp:     (I + sum_k lam_k rho_A,k G^_k) Y = Q_L^T D (I - Q_R Q_R^T)         (one Cholesky, m_L x m_L)
    perp x R:     Y (I + sum_k lam_k rho_G,k A^_k) = (I - Q_L Q_L^T) D Q_R            (one Cholesky, m_R x m_R)
    L x R:        Y + sum_k lam_k G^_k Y A^_k = Q_L^T D Q_R

and X is the sum of the blocks mapped back. The first three are solved exactly; the last, a sum of Kronecker
products with no common eigenbasis, by conjugate gradient on m_L x m_R matrices (`conjugate`), preconditioned by
the closed-form inverse of I + s G_p (x) A_p, the Kronecker product nearest its terms (`pooled.nearest_mixture` of
the G^_k and A^_k). The other blocks being exact, its residual is the whole system's: it stops at |r| <= tolerance
|D|, from a start that depends on D alone (a resumed run repeats every iteration). Each iteration costs 2 K + 4
products of m x m matrices, against the whole weight's K projections and a pooled closed form.

Under row sharding (FSDP2) a process holds rows of D and of each U_G, hence of Q_L: the Gram matrices that make Q_L
orthonormal, Q_L^T D, Q_L^T U_G,k and |D|^2 are completed by `reduce` (an all-reduce); the small blocks are then the
same on every process and solved alike without communication.
"""

from collections.abc import Sequence

import torch

from .basis import KroneckerBasis, Reduce, no_reduce
from .conjugate import Solve, conjugate_gradient
from .pooled import nearest_mixture

NEGLIGIBLE = 1e-10  # a direction of the stacked eigenvectors whose Gram eigenvalue is below this share of the largest


def _orthonormal(w: torch.Tensor, reduce: Reduce) -> torch.Tensor:
    """Q (rows x m), orthonormal columns spanning w's (rows held here): Q = W V diag(sigma)^-1/2 from the Gram
    matrix W^T W = V diag(sigma) V^T (directions below `NEGLIGIBLE` dropped), applied twice (the second pass brings
    Q^T Q to I within rounding)."""
    for _ in range(2):
        gram = w.T @ w
        reduce([gram])
        sigma, v = torch.linalg.eigh(gram)
        keep = sigma > NEGLIGIBLE * sigma.max()
        w = w @ (v[:, keep] / sigma[keep].sqrt())
    return w


def _side(parts: list[tuple[torch.Tensor, torch.Tensor, float]], reduce: Reduce):
    """(Q, [G^_k], [rho_k]) of one side from each term's (U, v, rho) (module docstring), float64."""
    vectors = [u.double() for u, _, _ in parts]
    q = _orthonormal(torch.cat(vectors, dim=-1), reduce)
    coordinates = [q.T @ u for u in vectors]
    reduce(coordinates)
    eye = torch.eye(q.shape[1], dtype=torch.float64, device=q.device)
    small = [
        torch.addmm(eye * rho, c * (v.double() - rho), c.T) for c, (_, v, rho) in zip(coordinates, parts, strict=True)
    ]
    return q, small, [rho for _, _, rho in parts]


class CoreBlock:
    """The L x R block's operator Y -> Y + sum_k lam_k G^_k Y A^_k and its preconditioner (module docstring)."""

    def __init__(self, lams: Sequence[float], left: list[torch.Tensor], right: list[torch.Tensor]):
        self.terms = list(zip(lams, left, right, strict=True))
        h_g = torch.stack([torch.stack([(x * y).sum() for y in left]) for x in left])
        h_a = torch.stack([torch.stack([(x * y).sum() for y in right]) for x in right])
        c, d, self.s = nearest_mixture(h_g, h_a, list(lams))
        mu, self.g_vectors = torch.linalg.eigh(_combination(c.tolist(), left))
        nu, self.a_vectors = torch.linalg.eigh(_combination(d.tolist(), right))
        self.kept = (1.0 + self.s * mu.clamp(min=0)[:, None] * nu.clamp(min=0)[None, :]).reciprocal()

    def apply(self, y: torch.Tensor) -> torch.Tensor:
        result = y.clone()
        for lam, g, a in self.terms:
            result.add_(g @ y @ a, alpha=lam)
        return result

    def precondition(self, r: torch.Tensor) -> torch.Tensor:
        """(I + s G_p (x) A_p)^-1 R, in the eigenvectors of G_p and A_p."""
        rotated = self.g_vectors.T @ r @ self.a_vectors
        return self.g_vectors @ (rotated * self.kept) @ self.a_vectors.T


def solve_blocks(
    d: torch.Tensor,
    factored: list[tuple[KroneckerBasis, float]],
    reduce: Reduce,
    tolerance: float,
    max_iterations: int,
) -> Solve:
    """X = (I + sum_k lam_k G_k (x) A_k)^-1 D for the K-FAC terms (basis, lam_k), D the rows held here (float64),
    by the four blocks of the module docstring, conjugate gradient on L x R to `tolerance` |D| or `max_iterations`
    (`summed_solve` passes its own); iterations and residual are the L x R block's."""
    lams = [float(lam) for _, lam in factored]
    q_l, g_small, g_tails = _side([(b.g_vectors, b.g_values, float(b.tails()[1])) for b, _ in factored], reduce)
    q_r, a_small, a_tails = _side([(b.a_vectors, b.a_values, float(b.tails()[0])) for b, _ in factored], no_reduce)
    rows, square = q_l.T @ d, (d * d).sum().reshape(1)
    reduce([rows, square])
    columns = d @ q_r
    core = rows @ q_r
    corner = 1.0 + sum(lam * g * a for lam, g, a in zip(lams, g_tails, a_tails, strict=True))
    left = torch.linalg.cholesky(_shifted([lam * a for lam, a in zip(lams, a_tails, strict=True)], g_small))
    right = torch.linalg.cholesky(_shifted([lam * g for lam, g in zip(lams, g_tails, strict=True)], a_small))
    row_block = torch.cholesky_solve(rows - core @ q_r.T, left)
    column_block = torch.cholesky_solve((columns - q_l @ core).T, right).T
    block = CoreBlock(lams, g_small, a_small)
    solve = conjugate_gradient(
        core,
        block.apply,
        block.precondition,
        lambda a, b: (a * b).sum(),
        float(square.sqrt()),
        tolerance,
        max_iterations,
    )
    x = d / corner
    x.addmm_(q_l, row_block - rows / corner)
    x.addmm_(column_block - columns / corner, q_r.T)
    x.add_(q_l @ (solve.x + core / corner) @ q_r.T)
    return Solve(x, solve.iterations, solve.residual)


def _combination(weights: Sequence[float], small: list[torch.Tensor]) -> torch.Tensor:
    """sum_k weights_k X_k for the small matrices X_k."""
    return torch.einsum(
        "k,kij->ij", torch.tensor(weights, dtype=small[0].dtype, device=small[0].device), torch.stack(small)
    )


def _shifted(weights: Sequence[float], small: list[torch.Tensor]) -> torch.Tensor:
    """I + sum_k weights_k X_k."""
    return _combination(weights, small).add_(
        torch.eye(small[0].shape[0], dtype=small[0].dtype, device=small[0].device)
    )
