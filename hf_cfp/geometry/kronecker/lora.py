"""The K-FAC CFP correction carried to LoRA factors (pure tensor math, one adapter on one weight).

A LoRA-adapted weight moves by D = s B A - C, C = s0 B0 A0 (B: out x r, A: r x in). Under a K-FAC base anchor,
F_W ~ A_in (x) G (A_in: in x in, G: out x out, as eigenbases `basis.KroneckerBasis`), full-parameter CFP's
target is D' = prox(D) (`basis.kfac_pull_`). The rules, each returning new factors (B', A), float32:

- `proximal_b`: the exact proximal step restricted to B with A fixed,

      B' = argmin_B ||X - D||^2 + lam tr(X^T G X A_in),      X = s B A - C.

  Setting the gradient to zero: s B (A A^T) + lam s G B (A A_in A^T) = (C + D) A^T + lam G C A_in A^T =: H.
  In G's eigenbasis (B~ = U_G^T B, H~ = U_G^T H) row i decouples into one r x r system,
  s b~_i (M1 + lam gamma_i M2) = h~_i with M1 = A A^T, M2 = A A_in A^T (both r x r); the part of B outside a
  truncated U_G (eigenvalue rho_G there, the tail) solves s B_perp (M1 + lam rho_G M2) = H_perp. With the tails
  (`basis`), A_in = U_A diag(alpha - rho_A) U_A^T + rho_A I and G likewise.
- `least_squares_b`: the unweighted fit of the full-parameter target, B' = (D' + C) A^T (A A^T)^-1 / s.

`factor_space` (elementwise CFP in factor coordinates) has no K-FAC form and is refused by the caller.
"""

from collections.abc import Callable

import torch

from ..lora import LoraFactors
from .basis import KroneckerBasis
from .proximal import kfac_pull_


def kfac_target(delta: torch.Tensor, basis: KroneckerBasis, lam: float) -> torch.Tensor:
    """D' = D - Q_G [w * (Q_G^T D Q_A)] Q_A^T: what full-parameter K-FAC CFP makes of the displacement D."""
    target = delta.clone()
    kfac_pull_([target], [torch.zeros_like(delta)], [basis], lam)
    return target


def kfac_proximal_b(
    factors: LoraFactors, basis: KroneckerBasis, lam: float, delta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """B' of the exact proximal step restricted to B (module docstring), solved in float64; A unchanged."""
    a, s = factors.a.double(), factors.scale
    q_a, alpha = basis.a_vectors.double(), basis.a_values.double()
    q_g, gamma = basis.g_vectors.double(), basis.g_values.double()
    rho_a, rho_g = (float(t) for t in basis.tails())
    a_rotated = a @ q_a  # A U_A, r x r_A
    m1 = a @ a.T
    m2 = (a_rotated * (alpha - rho_a)) @ a_rotated.T + rho_a * m1  # A A_in A^T
    offset = (factors.scale0 * (factors.b0 @ factors.a0)).double() if factors.scale0 != 0 else None
    rhs = delta.double() @ a.T
    if offset is not None and offset.any():
        rhs += offset @ a.T
        weighted = ((offset @ q_a) * (alpha - rho_a)) @ a_rotated.T + rho_a * (offset @ a.T)  # C A_in A^T
        rhs += lam * ((q_g * (gamma - rho_g)) @ (q_g.T @ weighted) + rho_g * weighted)  # lam G C A_in A^T
    inside = q_g.T @ rhs  # H~ on the kept rows of the eigenbasis
    systems = m1 + lam * gamma[:, None, None] * m2  # r_G systems of r x r
    b_inside = torch.linalg.solve(systems, inside.unsqueeze(-1)).squeeze(-1)
    outside = rhs - q_g @ inside  # H on the directions outside U_G (0 at full rank), eigenvalue rho_G there
    b = q_g @ b_inside + torch.linalg.solve(m1 + lam * rho_g * m2, outside.T).T
    return (b / s).float(), factors.a


def kfac_least_squares_b(
    factors: LoraFactors, basis: KroneckerBasis, lam: float, delta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """B' = (D' + C) A^T (A A^T)^-1 / s for the K-FAC target D', A unchanged."""
    a, s = factors.a, factors.scale
    target = torch.addmm(kfac_target(delta, basis, lam), factors.b0, factors.a0, alpha=factors.scale0)
    b = torch.linalg.solve((a @ a.T).double(), (a @ target.T).double()).T.float() / s
    return b, a


KfacLoraRule = Callable[[LoraFactors, KroneckerBasis, float, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

KFAC_LORA_RULES: dict[str, KfacLoraRule] = {"proximal_b": kfac_proximal_b, "least_squares_b": kfac_least_squares_b}
