"""The Kronecker-factored (K-FAC) geometry of a Linear-like weight: its CFP correction and its drift (pure math).

For a weight W (out x in) an anchor keeps F_W ~ A (x) G as eigenbases, A = Q_A diag(alpha) Q_A^T (in x in, the
layer inputs' second moment) and G = Q_G diag(gamma) Q_G^T (out x out, the output gradients'), possibly truncated
to their top r_A and r_G eigenpairs. In the rotated coordinates R = Q_G^T Delta Q_A (r_G x r_A) the quadratic
is diagonal:

    Delta^T F Delta ~ tr(Delta^T G Delta A) = sum_ij gamma_i alpha_j R_ij^2,

so the CFP correction, the exact proximal map of (lam / 2) tr(X^T G X A) applied to the proposal D = theta' -
theta0, is elementwise there:

    Delta = D - Q_G [ w * (Q_G^T D Q_A) ] Q_A^T,      w_ij = lam gamma_i alpha_j / (1 + lam gamma_i alpha_j)

(with full bases: Delta = Q_G [ (Q_G^T D Q_A) / (1 + lam gamma alpha^T) ] Q_A^T). A truncated basis pulls on
its block alone: the coordinates outside it have weight 0 and keep the proposal.

Under row sharding (FSDP2 splits W along its first dimension) a process holds rows of W and the same rows of
Q_G: its `rotate` is a partial sum of R, and `reduce` (an all-reduce across processes) completes it.

A basis may carry a leading batch dimension (the bases of n weights of one shape stacked, `protection.kronecker`):
every function below then works on the stacked weights (n x out x in) at once, by batched matrix products. The
rotations multiply in the eigenvectors' dtype (bfloat16 bases for bfloat16 weights: the products' rounding, 2^-8
of the rotated displacement, is at or below the weights' own), everything else in float32.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

# Completes a list of partial rotations in place (an all-reduce under row sharding; nothing on one process).
Reduce = Callable[[list[torch.Tensor]], None]


def _no_reduce(tensors: list[torch.Tensor]) -> None:
    """One process holds every row: the rotations are already complete."""


@dataclass(frozen=True)
class KroneckerBasis:
    """The eigenbases of one weight's factors, float32, on the weight's device.

    Args:
        a_vectors: Q_A, in x r_A, orthonormal columns (the input factor's top eigenvectors); optionally stacked,
            n x in x r_A, as every part then.
        a_values: alpha, r_A, >= 0.
        g_vectors: Q_G, rows x r_G, the rows of the output factor's top eigenvectors for the rows of W held here
            (all of them on one process).
        g_values: gamma, r_G, >= 0.
    """

    a_vectors: torch.Tensor
    a_values: torch.Tensor
    g_vectors: torch.Tensor
    g_values: torch.Tensor

    def products(self) -> torch.Tensor:
        """gamma_i alpha_j, r_G x r_A (float32): the quadratic's weights in the rotated coordinates."""
        return self.g_values.float().unsqueeze(-1) * self.a_values.float().unsqueeze(-2)

    def rotate(self, delta: torch.Tensor) -> torch.Tensor:
        """Q_G^T Delta Q_A (a partial sum over the rows held here), multiplied in the eigenvectors' dtype, float32."""
        d = delta.to(self.a_vectors.dtype)
        return (self.g_vectors.transpose(-2, -1) @ (d @ self.a_vectors)).float()

    def unrotate(self, rotated: torch.Tensor) -> torch.Tensor:
        """Q_G R Q_A^T on the rows held here, multiplied in the eigenvectors' dtype, float32."""
        r = rotated.to(self.a_vectors.dtype)
        return ((self.g_vectors @ r) @ self.a_vectors.transpose(-2, -1)).float()


def rotated_displacements(
    params: Sequence[torch.Tensor],
    theta0: Sequence[torch.Tensor],
    bases: Sequence[KroneckerBasis],
    reduce: Reduce = _no_reduce,
) -> list[torch.Tensor]:
    """R_k = Q_G^T (theta_k - theta0_k) Q_A for every weight, complete (one `reduce` for all)."""
    with torch.no_grad():
        rotated = [basis.rotate(p - t) for p, t, basis in zip(params, theta0, bases, strict=True)]
    reduce(rotated)
    return rotated


def pull_weights(basis: KroneckerBasis, lam: float) -> torch.Tensor:
    """w = lam gamma alpha^T / (1 + lam gamma alpha^T), r_G x r_A: the share of each rotated coordinate pulled back."""
    strength = basis.products().mul_(float(lam))
    return strength.div_(strength + 1.0)


def kfac_pull_(
    params: Sequence[torch.Tensor],
    theta0: Sequence[torch.Tensor] | None,
    bases: Sequence[KroneckerBasis],
    lam: float,
    rotated: Sequence[torch.Tensor] | None = None,
    reduce: Reduce = _no_reduce,
) -> None:
    """In place, on every weight: theta <- theta0 + D - Q_G [w * (Q_G^T D Q_A)] Q_A^T, D = theta - theta0,
    w = lam gamma alpha^T / (1 + lam gamma alpha^T) (module docstring), computed in float32 and rounded once to
    each parameter's dtype. `rotated`: the R = Q_G^T D Q_A already computed for these proposals (the KL budget's
    solve computes them first; `theta0` is then not read); by default computed here. Temporaries: a few tensors
    the size of one weight (of one stack of weights)."""
    if lam == 0:
        return
    with torch.no_grad():
        if rotated is None:
            assert theta0 is not None, "kfac_pull_ needs theta0 or the rotated proposals"
            rotated = rotated_displacements(params, theta0, bases, reduce)
        for param, basis, r in zip(params, bases, rotated, strict=True):
            shrink = basis.unrotate(r * pull_weights(basis, lam))
            param.copy_(param.float().sub_(shrink))  # theta0 + (D - shrink) = theta - shrink


def kfac_drift_squares(
    params: Sequence[torch.Tensor],
    theta0: Sequence[torch.Tensor],
    bases: Sequence[KroneckerBasis],
    threshold: float,
    reduce: Reduce = _no_reduce,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The drift of K-FAC weights in their rotated coordinates, as float64 sums on the CPU:

    (complete [sum gamma alpha R^2, -(sum of R^2 over gamma alpha > threshold)], local [sum Delta^2]).

    The first pair is complete on every process (from the reduced R); the local sum runs over the rows held here
    and must be added across processes. The free drift^2 over these weights, the sum of the squared rotated
    coordinates whose weight is <= threshold, is then complete[1] + sum Delta^2: rotation keeps the norm, and
    the coordinates outside a truncated basis have weight 0."""
    rotated = rotated_displacements(params, theta0, bases, reduce)
    sums = []  # summed on the device, moved to the CPU once
    with torch.no_grad():
        for param, start, basis, r in zip(params, theta0, bases, rotated, strict=True):
            squares, weights = r.square(), basis.products()
            sums.append(
                torch.stack(
                    [
                        torch.mul(squares, weights).sum(dtype=torch.float64),
                        -torch.where(weights > threshold, squares, 0.0).sum(dtype=torch.float64),
                        (param.float() - start.float()).square().sum(dtype=torch.float64),
                    ]
                )
            )
    total = torch.stack(sums).sum(0).cpu() if sums else torch.zeros(3, dtype=torch.float64)
    return total[:2], total[2:]


def kfac_budget_terms(rotated: Sequence[torch.Tensor], bases: Sequence[KroneckerBasis], lam: float) -> torch.Tensor:
    """[KL, dKL / dlam] (float64 [2], CPU) of the K-FAC weights for the proposals' rotated coordinates R' (the KL
    budget's solve, `ops.budget`): with P = gamma alpha^T the weights of the quadratic,

        KL = 0.5 sum P R'^2 / (1 + lam P)^2,      dKL / dlam = - sum P^2 R'^2 / (1 + lam P)^3,

    the predicted KL after the correction `kfac_pull_` would make with this lam (its rotated coordinates are
    R' / (1 + lam P) on the kept block, the rest has weight 0)."""
    terms = []  # summed on the device, moved to the CPU once
    with torch.no_grad():
        for r, basis in zip(rotated, bases, strict=True):
            weights = basis.products()
            relief = weights.mul(float(lam)).add_(1.0)
            weighted = r.square().mul_(weights).div_(relief.square())  # P R'^2 / (1 + lam P)^2
            kl = 0.5 * weighted.sum(dtype=torch.float64)
            slope = -weighted.mul_(weights).div_(relief).sum(dtype=torch.float64)
            terms.append(torch.stack([kl, slope]))
    return torch.stack(terms).sum(0).cpu() if terms else torch.zeros(2, dtype=torch.float64)
