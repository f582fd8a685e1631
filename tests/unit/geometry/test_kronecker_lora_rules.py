"""The K-FAC LoRA rules (`geometry.kronecker.lora`) against dense float64 solves on row-major vec."""

import pytest
import torch

from hf_cfp.geometry.kronecker.basis import KroneckerBasis
from hf_cfp.geometry.kronecker.lora import kfac_least_squares_b, kfac_proximal_b, kfac_target
from hf_cfp.geometry.lora import LoraFactors


def psd(n: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, n, generator=g, dtype=torch.float64)
    return x @ x.T / n


def basis_of(a_in, g_out, rank_a=None, rank_g=None):
    alpha, qa = torch.linalg.eigh(a_in)
    gamma, qg = torch.linalg.eigh(g_out)
    ka, kg = rank_a or len(alpha), rank_g or len(gamma)
    return KroneckerBasis(qa[:, -ka:].float(), alpha[-ka:].float(), qg[:, -kg:].float(), gamma[-kg:].float())


def kept(m, rank):
    values, vectors = torch.linalg.eigh(m)
    k = rank or len(values)
    return vectors[:, -k:] @ torch.diag(values[-k:]) @ vectors[:, -k:].T


def lora(out_dim, in_dim, rank, g, offset: bool) -> LoraFactors:
    b, a = torch.randn(out_dim, rank, generator=g), torch.randn(rank, in_dim, generator=g)
    b0 = torch.randn(out_dim, rank, generator=g) if offset else torch.zeros(out_dim, rank)
    a0 = torch.randn(rank, in_dim, generator=g)
    return LoraFactors(2.0, b, a, 1.5 if offset else 2.0, b0, a0)


@pytest.mark.parametrize("offset,ranks", [(False, (None, None)), (True, (None, None)), (True, (3, 2))])
def test_proximal_b_is_the_dense_minimizer_over_b(offset, ranks):
    """argmin_B ||X - D||^2 + lam vec(X)^T (G (x) A_in) vec(X), X = s B A - C, from the dense normal equations:
    M^T (I + lam K) M b = M^T (c + d) + lam M^T K c, with vec(s B A) = M vec(B), M = s (I (x) A^T)."""
    g = torch.Generator().manual_seed(0)
    out_dim, in_dim, rank, lam = 4, 5, 2, 3.0
    a_in, g_out = psd(in_dim, g), psd(out_dim, g)
    basis = basis_of(a_in, g_out, *ranks)
    factors = lora(out_dim, in_dim, rank, g, offset)
    c = (factors.scale0 * factors.b0 @ factors.a0).double()
    delta = factors.displacement().double()
    kernel = torch.kron(kept(g_out, ranks[1]), kept(a_in, ranks[0]))
    m = factors.scale * torch.kron(torch.eye(out_dim, dtype=torch.float64), factors.a.double().T.contiguous())
    lhs = m.T @ (torch.eye(out_dim * in_dim, dtype=torch.float64) + lam * kernel) @ m
    rhs = m.T @ (c + delta).reshape(-1) + lam * m.T @ kernel @ c.reshape(-1)
    expected = torch.linalg.solve(lhs, rhs).reshape(out_dim, rank)
    b, a = kfac_proximal_b(factors, basis, lam, delta.float())
    assert a is factors.a
    assert torch.allclose(b.double(), expected, rtol=1e-4, atol=1e-5)


def test_least_squares_b_fits_the_full_parameter_target():
    g = torch.Generator().manual_seed(1)
    a_in, g_out = psd(5, g), psd(4, g)
    basis = basis_of(a_in, g_out)
    factors = lora(4, 5, 2, g, offset=True)
    delta = factors.displacement()
    target = kfac_target(delta, basis, 2.0)
    dense = torch.linalg.solve(
        torch.eye(20, dtype=torch.float64) + 2.0 * torch.kron(g_out, a_in), delta.double().reshape(-1)
    )
    assert torch.allclose(target.double().reshape(-1), dense, atol=1e-5)
    b, _ = kfac_least_squares_b(factors, basis, 2.0, delta)
    c = (factors.scale0 * factors.b0 @ factors.a0).double()
    want = torch.linalg.lstsq(factors.scale * factors.a.double().T, (target.double() + c).T).solution.T
    assert torch.allclose(b.double(), want, atol=1e-5)


def with_mean_tail(m, rank):
    """(U, values, rho) of the top `rank` eigenpairs of m and the mean of the rest, and the dense
    U diag(values) U^T + rho (I - U U^T) (float64)."""
    values, vectors = torch.linalg.eigh(m)
    values, vectors = values.flip(0), vectors.flip(1)
    rho = values[rank:].mean()
    u = vectors[:, :rank]
    dense = u @ torch.diag(values[:rank]) @ u.T + rho * (torch.eye(len(values), dtype=torch.float64) - u @ u.T)
    return u.float(), values[:rank].float(), rho.float(), dense


@pytest.mark.parametrize("offset", [False, True])
def test_proximal_b_with_tails_is_the_dense_minimizer_over_b(offset):
    """The same normal equations with the factors' top eigenpairs plus their mean tails, A_in,r (x) G_r."""
    g = torch.Generator().manual_seed(2)
    out_dim, in_dim, rank, lam = 5, 6, 2, 3.0
    ua, alpha, rho_a, a_r = with_mean_tail(psd(in_dim, g), 2)
    ug, gamma, rho_g, g_r = with_mean_tail(psd(out_dim, g), 3)
    basis = KroneckerBasis(ua, alpha, ug, gamma, rho_a, rho_g)
    factors = lora(out_dim, in_dim, rank, g, offset)
    c = (factors.scale0 * factors.b0 @ factors.a0).double()
    delta = factors.displacement().double()
    kernel = torch.kron(g_r, a_r)
    m = factors.scale * torch.kron(torch.eye(out_dim, dtype=torch.float64), factors.a.double().T.contiguous())
    lhs = m.T @ (torch.eye(out_dim * in_dim, dtype=torch.float64) + lam * kernel) @ m
    rhs = m.T @ (c + delta).reshape(-1) + lam * m.T @ kernel @ c.reshape(-1)
    expected = torch.linalg.solve(lhs, rhs).reshape(out_dim, rank)
    b, _ = kfac_proximal_b(factors, basis, lam, delta.float())
    assert torch.allclose(b.double(), expected, rtol=1e-4, atol=1e-5)
