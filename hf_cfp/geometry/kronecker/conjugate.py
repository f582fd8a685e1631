"""Preconditioned conjugate gradient for a symmetric positive definite operator on matrices (pure math): the solver
of the summed proximal map (`summed_solve`, `summed_blocks`)."""

from collections.abc import Callable
from dataclasses import dataclass

import torch

Operator = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Solve:
    """The solution X, the conjugate-gradient iterations taken, and the relative residual reached."""

    x: torch.Tensor
    iterations: int
    residual: float


def conjugate_gradient(
    b: torch.Tensor,
    apply: Operator,
    precondition: Operator,
    dot: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    scale: float,
    tolerance: float,
    max_iterations: int,
) -> Solve:
    """The X with apply(X) = B, from X_0 = precondition(B) (a function of B alone, so a repeated solve repeats every
    iteration bit for bit), until |B - apply(X)| <= tolerance x scale or after `max_iterations`; `dot` is the
    inner product (completed across processes where the rows are sharded); residuals are reported / scale."""
    x = precondition(b)
    r = b - apply(x)
    residual = float(dot(r, r).sqrt()) / scale if scale > 0 else 0.0
    z = precondition(r)
    p, rz = z, dot(r, z)
    iterations = 0
    while residual > tolerance and iterations < max_iterations:
        q = apply(p)
        alpha = float(rz / dot(p, q))
        x.add_(p, alpha=alpha)
        r.sub_(q, alpha=alpha)
        iterations += 1
        residual = float(dot(r, r).sqrt()) / scale
        if residual <= tolerance:
            break
        z = precondition(r)
        rz, previous = dot(r, z), rz
        p = z.add_(p, alpha=float(rz / previous))
    return Solve(x, iterations, residual)
