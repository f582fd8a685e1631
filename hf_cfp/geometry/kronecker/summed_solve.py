"""The CFP correction of one weight under several protecting anchors: the proximal map of their summed penalty.

Anchors k with Kronecker factors on a weight W (out x in), K_k = G_k,r (x) A_k,r (`basis`), and anchors j with
a diagonal F_j on it, at strengths lam, penalize a displacement X by

    0.5 sum_k lam_k tr(X^T G_k,r X A_k,r) + 0.5 sum_j lam_j sum F_j X^2,

and the correction is its exact proximal map at the proposal D = theta' - theta0: the X that solves

    (I + sum_k lam_k K_k + diag(sum_j lam_j F_j)) vec(X) = vec(D)        (row-major vec).

A sum of Kronecker products has no common eigenbasis, so no closed form: the system (symmetric positive definite)
is solved by preconditioned conjugate gradient. Each product with K_k is one projection onto the anchor's
eigenvectors and back (`block_factors` with the blocks' scales lam_k e: 4 out x in x r multiply-adds); the
preconditioner is the closed-form inverse (I + lam_p K_p)^-1 of one K-FAC term (`basis.shrink_factors`), the
one with the largest lam_k x (largest eigenvalue); the start is that term's closed form applied to D (the
one-anchor correction), a function of D alone, so a resumed run repeats every iteration bit for bit. It stops when
the relative residual |D - A X| / |D| is at most `tolerance(dtype)` (1e-6 in float64; 1e-5, float32's floor for
these products, otherwise) or after `MAX_ITERATIONS`. Cost: (1 + K) products to start, then (1 + K) per
iteration, against 1 for one anchor's closed form.

Under row sharding (FSDP2) a process holds rows of X and of each U_G: the projections' partial sums and the dot
products are completed by `reduce` (an all-reduce), so every process takes the same iterations.
"""

from dataclasses import dataclass

import torch

from .basis import KroneckerBasis, Reduce, projected
from .proximal import block_factors, shrink_factors

MAX_ITERATIONS = 100


def tolerance(dtype: torch.dtype) -> float:
    """The relative residual the solve stops at: 1e-6 for float64 weights, 1e-5 (the float32 floor) otherwise."""
    return 1e-6 if dtype == torch.float64 else 1e-5


def _complete(tensors: list[torch.Tensor]) -> None:
    """One process holds every row: the sums are already complete."""


@dataclass(frozen=True)
class SummedPenalty:
    """The summed penalty on one weight, oriented out x in, for the rows held here.

    Args:
        factored: (basis, lam_k) of each K-FAC term (bases in the solve's dtype).
        diagonal: sum_j lam_j F_j over the diagonal terms (the rows held here), or None without one.
    """

    factored: list[tuple[KroneckerBasis, float]]
    diagonal: torch.Tensor | None = None

    def apply(self, x: torch.Tensor, reduce: Reduce = _complete) -> torch.Tensor:
        """(I + sum_k lam_k K_k + diag(sum_j lam_j F_j)) X, one projection per K-FAC term (one `reduce` for all)."""
        result = x.clone() if self.diagonal is None else torch.addcmul(x, self.diagonal, x)
        bases = [basis for basis, _ in self.factored]
        for (basis, lam), projection in zip(self.factored, projected([x] * len(bases), bases, reduce), strict=True):
            scales = [w.mul(float(lam)) for w in basis.block_weights()]
            left, right, tail = block_factors(basis, projection, scales)
            result.addmm_(left.to(x.dtype), right.to(x.dtype))
            if tail is not None:
                result.add_(x, alpha=float(tail))
        return result

    def preconditioner(self) -> tuple[KroneckerBasis, float]:
        """The K-FAC term whose closed-form inverse preconditions the solve: the largest lam_k x max eigenvalue."""
        return max(self.factored, key=lambda term: term[1] * float(term[0].block_weights()[0].max()))


def closed_form(basis: KroneckerBasis, lam: float, x: torch.Tensor, reduce: Reduce = _complete) -> torch.Tensor:
    """(I + lam K)^-1 X = X - shrink (`basis.shrink_factors`), one anchor's exact proximal map."""
    projection = projected([x], [basis], reduce)[0]
    left, right, tail = shrink_factors(basis, projection, lam)
    result = torch.addmm(x, left.to(x.dtype), right.to(x.dtype), alpha=-1)
    return result if tail is None else result.sub_(x, alpha=float(tail))


@dataclass(frozen=True)
class Solve:
    """The solution X, the conjugate-gradient iterations taken, and the relative residual reached."""

    x: torch.Tensor
    iterations: int
    residual: float


def solve_summed(
    d: torch.Tensor, penalty: SummedPenalty, reduce: Reduce = _complete, max_iterations: int = MAX_ITERATIONS
) -> Solve:
    """The proximal map X = (I + sum_k lam_k K_k + diag(sum_j lam_j F_j))^-1 D of the summed penalty at the
    proposal D (module docstring), by preconditioned conjugate gradient in D's dtype (float32 or float64)."""
    basis, lam = penalty.preconditioner()
    stop = tolerance(d.dtype)

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
