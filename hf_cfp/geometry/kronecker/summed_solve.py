"""The CFP correction of one weight under several protecting anchors: the proximal map of their summed penalty.

Anchors k with Kronecker factors on a weight W (out x in), K_k = G_k,r (x) A_k,r (`basis`), and anchors j with
a diagonal F_j on it, at strengths lam, penalize a displacement X by

    0.5 sum_k lam_k tr(X^T G_k,r X A_k,r) + 0.5 sum_j lam_j sum F_j X^2,

and the correction is its exact proximal map at the proposal D = theta' - theta0: the X that solves

    (I + sum_k lam_k K_k + diag(sum_j lam_j F_j)) vec(X) = vec(D)        (row-major vec).

A sum of Kronecker products has no common eigenbasis, so no closed form: the system (symmetric positive definite)
is solved by preconditioned conjugate gradient (`conjugate`), in float64 whatever the weights' dtype (strengths lam
e reach 1e5-1e6 for anchors at c = 10 on the embedded model, which leaves a float32 residual a floor near 1e-7 x
1e6), until the relative residual |D - A X| / |D| is at most `TOLERANCE` (1e-6) or after `MAX_ITERATIONS`. The
start is the preconditioner applied to D, a function of D alone, so a resumed run repeats every iteration bit for
bit (a start from the previous step's solution would need a weight-sized buffer per weight, saved in every
checkpoint).

- K-FAC terms alone (`summed_blocks`): three of the four blocks of the anchors' pooled eigenvectors are solved in
  closed form; conjugate gradient runs on the remaining one, a matrix of at most (sum r_G) x (sum r_A).
- With a diagonal term: conjugate gradient on the whole weight. Each product with K_k is one projection onto the
  anchor's eigenvectors and back (`proximal.block_factors` with the blocks' scales lam_k e: 4 out x in x r
  multiply-adds); the preconditioner is the closed-form inverse of the Kronecker product nearest the K-FAC terms,
  (I + s G_p (x) A_p)^-1 (`pooled`; its rank is up to the sum of theirs).

Under row sharding (FSDP2) a process holds rows of X and of each U_G: the projections' partial sums and the dot
products are completed by `reduce` (an all-reduce), so every process takes the same iterations.
"""

from dataclasses import dataclass

import torch

from .basis import KroneckerBasis, Reduce, no_reduce, projected
from .conjugate import Solve, conjugate_gradient
from .pooled import pooled_term
from .proximal import block_factors, shrink_factors
from .summed_blocks import solve_blocks

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


def solve_summed(
    d: torch.Tensor,
    penalty: SummedPenalty,
    reduce: Reduce = no_reduce,
    max_iterations: int = MAX_ITERATIONS,
    preconditioner: tuple[KroneckerBasis, float] | None = None,
) -> Solve:
    """The proximal map X = (I + sum_k lam_k K_k + diag(sum_j lam_j F_j))^-1 D of the summed penalty at the
    proposal D (module docstring), in D's dtype (the callers pass float64). K-FAC terms alone: by their pooled
    eigenvectors' blocks (`summed_blocks`); with a diagonal term: by preconditioned conjugate gradient on the whole
    weight, `preconditioner` the pooled term (basis, s) when already computed (`pooled_term`), else computed here."""
    if penalty.diagonal is None:
        return solve_blocks(d, penalty.factored, reduce, TOLERANCE, max_iterations)
    basis, lam = penalty.preconditioner(reduce) if preconditioner is None else preconditioner

    def dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        total = torch.stack([(a * b).sum(dtype=torch.float64)])
        reduce([total])
        return total[0]

    return conjugate_gradient(
        d,
        lambda x: penalty.apply(x, reduce),
        lambda r: closed_form(basis, lam, r, reduce),
        dot,
        float(dot(d, d).sqrt()),
        TOLERANCE,
        max_iterations,
    )
