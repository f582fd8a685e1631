"""The CFP correction of one weight under several protecting anchors: the proximal map of their summed penalty.

Anchors k with Kronecker factors on a weight W (out x in), K_k = G_k,r (x) A_k,r (`basis`), and anchors j with
a diagonal F_j on it, at strengths lam, penalize a displacement X by

    0.5 sum_k lam_k tr(X^T G_k,r X A_k,r) + 0.5 sum_j lam_j sum F_j X^2,

and the correction is its exact proximal map at the proposal D = theta' - theta0: the X that solves

    (I + sum_k lam_k K_k + diag(sum_j lam_j F_j)) vec(X) = vec(D)        (row-major vec).

A sum of Kronecker products has no common eigenbasis, so no closed form: the system (symmetric positive definite)
is solved by preconditioned conjugate gradient. Each product with K_k is one projection onto the anchor's
eigenvectors and back (`proximal.block_factors` with the blocks' scales lam_k e: 4 out x in x r multiply-adds).
The preconditioner is the closed-form inverse of the Kronecker product nearest the sum, (I + s G_p (x) A_p)^-1
(`pooled`; exact when the anchors share a factor; its rank is up to the sum of theirs), and the start is
that preconditioner applied to D, a function of D alone, so a resumed run repeats every iteration bit for bit (a
start from the previous step's solution would need a weight-sized buffer per weight, saved in every checkpoint).
The solve runs in float64 whatever the weights' dtype: strengths lam e reach 1e5-1e6 for anchors at c = 10 on the
embedded model, which leaves a float32 residual a floor near 1e-7 x 1e6. It stops when the relative residual
|D - A X| / |D| is at most `TOLERANCE` (1e-6) or after `MAX_ITERATIONS`. Cost: K products and one preconditioner
to start, the same per iteration, against one closed form for one anchor.

Under row sharding (FSDP2) a process holds rows of X and of each U_G: the projections' partial sums and the dot
products are completed by `reduce` (an all-reduce), so every process takes the same iterations.
"""

from dataclasses import dataclass

import torch

from .basis import KroneckerBasis, Reduce, no_reduce, projected
from .pooled import pooled_term
from .proximal import block_factors, shrink_factors

MAX_ITERATIONS = 250  # anchors at c = 10 on the embedded model needed 97-169 (docs/reports/performance.md)
TOLERANCE = 1e-6  # the relative residual the solve stops at (it runs in float64)


@dataclass(frozen=True)
class SummedPenalty:
    """The summed penalty on one weight, oriented out x in, for the rows held here.

    Args:
        factored: (basis, lam_k) of each K-FAC term (bases in the solve's dtype).
        diagonal: sum_j lam_j F_j over the diagonal terms (the rows held here), or None without one.
    """

    factored: list[tuple[KroneckerBasis, float]]
    diagonal: torch.Tensor | None = None

    def apply(self, x: torch.Tensor, reduce: Reduce = no_reduce) -> torch.Tensor:
        """(I + sum_k lam_k K_k + diag(sum_j lam_j F_j)) X, one projection per K-FAC term (one `reduce` for all)."""
        result = x.clone() if self.diagonal is None else torch.addcmul(x, self.diagonal, x)
        bases = [basis for basis, _ in self.factored]
        for (basis, lam), projection in zip(self.factored, projected([x] * len(bases), bases, reduce), strict=True):
            scales = [w.to(x.dtype).mul(float(lam)) for w in basis.block_weights()]
            left, right, tail = block_factors(basis, projection, scales)
            result.addmm_(left.to(x.dtype), right.to(x.dtype))
            if tail is not None:
                result.add_(x, alpha=float(tail))
        return result

    def preconditioner(self, reduce: Reduce = no_reduce) -> tuple[KroneckerBasis, float]:
        """The pooled term whose closed-form inverse preconditions the solve (`pooled_term`); with one K-FAC term,
        that term."""
        return self.factored[0] if len(self.factored) == 1 else pooled_term(self.factored, reduce)


def closed_form(basis: KroneckerBasis, lam: float, x: torch.Tensor, reduce: Reduce = no_reduce) -> torch.Tensor:
    """(I + lam K)^-1 X, one anchor's exact proximal map; with a tail formed directly from each block's kept share
    1 / (1 + lam e) (`proximal.block_factors`), not as X minus a nearly equal shrink."""
    projection = projected([x], [basis], reduce)[0]
    if not basis.tailed:
        left, right, _ = shrink_factors(basis, projection, lam)
        return torch.addmm(x, left.to(x.dtype), right.to(x.dtype), alpha=-1)
    scales = [w.to(x.dtype).mul(float(lam)).add_(1.0).reciprocal_() for w in basis.block_weights()]
    left, right, tail = block_factors(basis, projection, scales)
    return torch.addmm(x, left.to(x.dtype), right.to(x.dtype), beta=float(tail))  # type: ignore[arg-type]


@dataclass(frozen=True)
class Solve:
    """The solution X, the conjugate-gradient iterations taken, and the relative residual reached."""

    x: torch.Tensor
    iterations: int
    residual: float


def solve_summed(
    d: torch.Tensor,
    penalty: SummedPenalty,
    reduce: Reduce = no_reduce,
    max_iterations: int = MAX_ITERATIONS,
    preconditioner: tuple[KroneckerBasis, float] | None = None,
) -> Solve:
    """The proximal map X = (I + sum_k lam_k K_k + diag(sum_j lam_j F_j))^-1 D of the summed penalty at the
    proposal D (module docstring), by preconditioned conjugate gradient, in D's dtype (the callers pass float64);
    `preconditioner`: the pooled term (basis, s) when already computed (`pooled_term`), else computed here."""
    basis, lam = penalty.preconditioner(reduce) if preconditioner is None else preconditioner
    stop = TOLERANCE

    def dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        total = torch.stack([(a * b).sum(dtype=torch.float64)])
        reduce([total])
        return total[0]

    target = float(dot(d, d).sqrt())
    x = closed_form(basis, lam, d, reduce)
    r = d - penalty.apply(x, reduce)
    residual = float(dot(r, r).sqrt()) / target if target > 0 else 0.0
    z = closed_form(basis, lam, r, reduce)
    p, rz = z, dot(r, z)
    iterations = 0
    while residual > stop and iterations < max_iterations:
        q = penalty.apply(p, reduce)
        alpha = float(rz / dot(p, q))
        x.add_(p, alpha=alpha)
        r.sub_(q, alpha=alpha)
        iterations += 1
        residual = float(dot(r, r).sqrt()) / target
        if residual <= stop:
            break
        z = closed_form(basis, lam, r, reduce)
        rz, previous = dot(r, z), rz
        p = z.add_(p, alpha=float(rz / previous))
    return Solve(x, iterations, residual)
