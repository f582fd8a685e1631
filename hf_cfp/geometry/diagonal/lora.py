"""The diagonal geometry's LoRA rules: the CFP correction carried to LoRA factors (pure tensor math, one adapter on
one weight).

A LoRA-adapted weight moves by D = s B A - s0 B0 A0 (B: out x r, A: r x in, (s0, B0, A0) at train
begin). Full-parameter CFP would replace it by the target

    D' = D / (1 + lam F)                                       (elementwise, F the base anchor's F_W)

which the adapter can represent only in part. Each rule below returns new factors (B', A'), float32:

- `proximal_b` (the default): the exact proximal step restricted to B, with A fixed. CFP's step is
  argmin_X ||X - D||^2 + lam sum F X^2 = argmin_X sum (1 + lam F) (X - D')^2, so with X = s B' A - s0 B0 A0,
  row i of B' solves an r x r weighted least-squares problem (w_ij = 1 + lam F_ij, t = D' + s0 B0 A0):

      b'_i = (A diag(w_i) A^T)^-1 A diag(w_i) t_i / s

- `least_squares_b`: the same without weights, B' = (D' + s0 B0 A0) A^T (A A^T)^-1 / s (one r x r solve).
- `factor_space`: elementwise CFP in factor coordinates with F pulled back through the adapter map,
  F_B = s^2 F (A * A)^T and F_A = s^2 (B * B)^T F, then B' = B0 + (B - B0) / (1 + lam F_B), likewise A.
  Cheaper, and not exact even when F is constant along rows.

When F is constant along each row (F_ij = u_i) and B0 A0 = 0, D' = diag(1 / (1 + lam u)) D = s diag(.) B A
lies in the adapter's range, and both B rules return B' = diag(1 / (1 + lam u)) B exactly. Rows of B whose F
row is 0 everywhere are returned bitwise unchanged by every rule (their target is the proposal).
"""

from collections.abc import Callable

import torch

from ..lora import LoraFactors


def cfp_target(delta: torch.Tensor, fisher: torch.Tensor, lam: float) -> torch.Tensor:
    """D' = D / (1 + lam F): what full-parameter CFP makes of the displacement D."""
    return delta / (1 + lam * fisher)


def proximal_b(
    factors: LoraFactors, fisher: torch.Tensor, lam: float, delta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """B' row by row: argmin sum_j (1 + lam F_ij) (s b'_i A_:j - s0 (B0 A0)_ij - D'_ij)^2, A unchanged.

    The normal equations, with w t = D + w s0 B0 A0: (A diag(w_i) A^T) b'_i = A (w_i t_i) / s, solved for all
    rows at once in float64, by Cholesky (the Gram matrices are symmetric positive definite when A has full
    rank; LU when rounding makes one indefinite). Their r (r + 1) / 2 distinct entries sum_j w_ij A_pj A_qj
    (p <= q) come from one (out x in) @ (in x r (r + 1) / 2) product. With B0 = 0 (LoRA's default) w t = D.
    """
    a, s = factors.a, factors.scale
    rank = a.shape[0]
    weight = 1 + lam * fisher
    rhs = delta @ a.T  # A (w_i t_i) for every row i
    if factors.scale0 != 0 and factors.b0.any():
        rhs += (factors.scale0 * weight * (factors.b0 @ factors.a0)) @ a.T
    p, q = torch.triu_indices(rank, rank, device=a.device)
    upper = (weight @ (a[p] * a[q]).T).double()  # out x r (r + 1) / 2
    where = torch.zeros(rank, rank, dtype=torch.long, device=a.device)  # (p, q) -> its column of `upper`
    where[p, q] = where[q, p] = torch.arange(len(p), device=a.device)
    gram = upper.index_select(1, where.view(-1)).view(-1, rank, rank)
    factor, info = torch.linalg.cholesky_ex(gram)
    if info.any():  # not numerically positive definite (A near rank-deficient): LU, as precise as it gets
        b = torch.linalg.solve(gram, rhs.double())
    else:
        b = torch.cholesky_solve(rhs.double().unsqueeze(-1), factor).squeeze(-1)
    b = b.float() / s
    return _keep_rows_without_fisher(b, factors.b, fisher), a


def least_squares_b(
    factors: LoraFactors, fisher: torch.Tensor, lam: float, delta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """B' = (D' + s0 B0 A0) A^T (A A^T)^-1 / s: the unweighted least-squares fit of the target, A unchanged."""
    a, s = factors.a, factors.scale
    target = torch.addmm(cfp_target(delta, fisher, lam), factors.b0, factors.a0, alpha=factors.scale0)
    b = torch.linalg.solve((a @ a.T).double(), (a @ target.T).double()).T.float() / s
    return _keep_rows_without_fisher(b, factors.b, fisher), a


def factor_space(
    factors: LoraFactors, fisher: torch.Tensor, lam: float, delta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """B' = lerp(B, B0, w_B), A' = lerp(A, A0, w_A), w = lam F_x / (1 + lam F_x) with the pulled-back
    F_B = s^2 F (A * A)^T and F_A = s^2 (B * B)^T F (both from the proposal's factors). `delta` is unused."""
    f = factors
    pull_b = lam * f.scale**2 * (fisher @ f.a.square().T)
    pull_a = lam * f.scale**2 * (f.b.square().T @ fisher)
    b = torch.lerp(f.b, f.b0, pull_b / (1 + pull_b))
    a = torch.lerp(f.a, f.a0, pull_a / (1 + pull_a))
    return b, a


def _keep_rows_without_fisher(new_b: torch.Tensor, old_b: torch.Tensor, fisher: torch.Tensor) -> torch.Tensor:
    """`new_b`, with the rows whose F row is 0 everywhere taken bitwise from `old_b`."""
    return torch.where((fisher > 0).any(dim=1, keepdim=True), new_b, old_b)


LoraRule = Callable[[LoraFactors, torch.Tensor, float, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

LORA_RULES: dict[str, LoraRule] = {
    "proximal_b": proximal_b,
    "least_squares_b": least_squares_b,
    "factor_space": factor_space,
}
