"""The LoRA correction rules against independent float64 references: per-row least squares by QR (lstsq), the
pseudo-inverse, an explicit loop for the pulled-back Fisher, and the closed form of the row-constant case."""

import pytest
import torch

from hf_cfp.geometry.diagonal.lora import LORA_RULES, cfp_target, factor_space, least_squares_b, proximal_b
from hf_cfp.geometry.lora import LoraFactors

OUT, RANK, IN = 7, 3, 9


def factors(seed=0, scale=2.0, nonzero_init=False):
    g = torch.Generator().manual_seed(seed)
    b0 = torch.randn(OUT, RANK, generator=g) if nonzero_init else torch.zeros(OUT, RANK)
    a0 = torch.randn(RANK, IN, generator=g)
    b = b0 + 0.3 * torch.randn(OUT, RANK, generator=g)
    a = a0 + 0.3 * torch.randn(RANK, IN, generator=g)
    return LoraFactors(scale, b, a, scale, b0, a0)


def fisher(seed=1, zero_rows=()):
    f = torch.rand(OUT, IN, generator=torch.Generator().manual_seed(seed)) * 3
    f[list(zero_rows)] = 0
    return f


def run(rule, f, fis, lam):
    return rule(f, fis, lam, f.displacement())


def test_displacement_is_s_b_a_minus_s0_b0_a0():
    f = factors(nonzero_init=True)
    f.scale0 = 0.5
    expected = f.scale * f.b.double() @ f.a.double() - 0.5 * f.b0.double() @ f.a0.double()
    torch.testing.assert_close(f.displacement().double(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("nonzero_init", [False, True], ids=["b0=0", "pissa-like"])
def test_proximal_b_is_the_weighted_least_squares_fit_row_by_row(nonzero_init):
    f, fis, lam = factors(nonzero_init=nonzero_init), fisher(), 2.5
    b, a = run(proximal_b, f, fis, lam)
    assert a is f.a
    d = f.displacement().double()
    w = 1 + lam * fis.double()
    offset = f.scale0 * f.b0.double() @ f.a0.double()
    target = d / w + offset
    for i in range(OUT):  # min_b sum_j w_ij (s b A_:j - t_ij)^2, by QR on the sqrt(w)-scaled system
        design = (w[i].sqrt()[:, None] * f.scale * f.a.double().T).contiguous()
        row = torch.linalg.lstsq(design, (w[i].sqrt() * target[i])[:, None]).solution[:, 0]
        torch.testing.assert_close(b[i].double(), row, rtol=1e-4, atol=1e-5)


def test_proximal_b_falls_back_to_lu_when_a_gram_matrix_is_not_positive_definite():
    f, fis, lam = factors(), fisher(), 2.5
    f.a[1] = f.a[0] + 1e-6 * f.a[2]  # A near rank-deficient: the float32 Gram matrices lose definiteness
    gram = torch.einsum("ij,pj,qj->ipq", (1 + lam * fis).double(), f.a.double(), f.a.double())
    assert torch.linalg.cholesky_ex(gram.float().double()).info.any()
    b, _ = run(proximal_b, f, fis, lam)
    assert torch.isfinite(b).all()
    f.a[1] = f.a[0]  # exactly rank-deficient: singular, as LU says
    with pytest.raises(torch.linalg.LinAlgError):
        run(proximal_b, f, fis, lam)


def test_least_squares_b_is_the_pseudo_inverse_fit():
    f, fis, lam = factors(nonzero_init=True), fisher(), 2.5
    b, a = run(least_squares_b, f, fis, lam)
    assert a is f.a
    target = f.displacement().double() / (1 + lam * fis.double()) + f.scale0 * f.b0.double() @ f.a0.double()
    expected = target @ torch.linalg.pinv(f.a.double()) / f.scale
    torch.testing.assert_close(b.double(), expected, rtol=1e-4, atol=1e-5)


def test_factor_space_pulls_each_factor_with_the_pulled_back_fisher():
    f, fis, lam = factors(nonzero_init=True), fisher(), 0.7
    b, a = run(factor_space, f, fis, lam)
    s2 = f.scale**2
    for i in range(OUT):
        for r in range(RANK):
            f_b = s2 * sum(float(fis[i, j]) * float(f.a[r, j]) ** 2 for j in range(IN))
            expected = float(f.b0[i, r]) + (float(f.b[i, r]) - float(f.b0[i, r])) / (1 + lam * f_b)
            assert float(b[i, r]) == pytest.approx(expected, rel=1e-5, abs=1e-6)
    for r in range(RANK):
        for j in range(IN):
            f_a = s2 * sum(float(fis[i, j]) * float(f.b[i, r]) ** 2 for i in range(OUT))
            expected = float(f.a0[r, j]) + (float(f.a[r, j]) - float(f.a0[r, j])) / (1 + lam * f_a)
            assert float(a[r, j]) == pytest.approx(expected, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("rule", ["proximal_b", "least_squares_b"])
def test_b_rules_are_exact_when_f_is_constant_along_rows(rule):
    f, lam = factors(), 4.0
    u = torch.rand(OUT, generator=torch.Generator().manual_seed(3)) * 5
    fis = u[:, None].expand(OUT, IN).contiguous()
    b, a = run(LORA_RULES[rule], f, fis, lam)
    torch.testing.assert_close(b, f.b / (1 + lam * u[:, None]), rtol=1e-5, atol=1e-7)  # the closed form
    after = f.displacement(b, a)
    target = cfp_target(f.displacement(), fis, lam)
    assert float((after - target).norm() / target.norm()) < 1e-5


def test_factor_space_is_not_exact_when_f_is_constant_along_rows():
    f, lam = factors(), 4.0
    fis = (torch.rand(OUT, generator=torch.Generator().manual_seed(3)) * 5)[:, None].expand(OUT, IN).contiguous()
    b, a = run(factor_space, f, fis, lam)
    target = cfp_target(f.displacement(), fis, lam)
    assert float((f.displacement(b, a) - target).norm() / target.norm()) > 1e-2


@pytest.mark.parametrize("rule", sorted(LORA_RULES))
def test_rows_without_fisher_keep_the_proposal_bitwise(rule):
    f = factors(nonzero_init=True)
    b, _ = run(LORA_RULES[rule], f, fisher(zero_rows=(1, 4)), 3.0)
    assert torch.equal(b[[1, 4]], f.b[[1, 4]])
    assert not torch.equal(b[0], f.b[0])


@pytest.mark.parametrize("rule", sorted(LORA_RULES))
def test_lam_zero_returns_the_proposal(rule):
    f = factors(nonzero_init=True)
    b, a = run(LORA_RULES[rule], f, fisher(), 0.0)
    torch.testing.assert_close(b, f.b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a, f.a, rtol=0, atol=0)


@pytest.mark.parametrize("rule", sorted(LORA_RULES))
def test_every_rule_cuts_the_weighted_drift(rule):
    f, fis = factors(), fisher()
    before = float((fis * f.displacement().square()).sum())
    b, a = run(LORA_RULES[rule], f, fis, 10.0)
    assert float((fis * f.displacement(b, a).square()).sum()) < 0.5 * before
