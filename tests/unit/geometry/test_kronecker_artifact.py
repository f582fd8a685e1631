"""K-FAC bases of an anchor (`geometry.kronecker.artifact`): decomposition of dense factors, validation, stored
keys."""

import pytest
import torch

from hf_cfp.errors import AnchorValidationError
from hf_cfp.geometry.kronecker.artifact import (
    basis_from_factors,
    basis_tensors,
    check_basis,
    dense_factors,
    kfac_weight_names,
    read_bases,
)
from hf_cfp.geometry.kronecker.views import RotatedWeights


def psd(n: int, seed: int, rank: int | None = None) -> torch.Tensor:
    x = torch.randn(n, rank or n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return x @ x.T


def test_full_basis_rebuilds_the_factors_and_a_truncated_one_the_best_rank_r_approximation():
    a, g = psd(5, 0), psd(3, 1)
    basis = basis_from_factors("w", a, g, "math")
    rebuilt_a, rebuilt_g = dense_factors(basis)
    assert torch.allclose(rebuilt_a.double(), a, rtol=1e-5, atol=1e-5 * float(a.abs().max()))
    assert torch.allclose(rebuilt_g.double(), g, rtol=1e-5, atol=1e-5 * float(g.abs().max()))
    assert torch.all(basis.a_values[:-1] >= basis.a_values[1:])  # largest first
    top = basis_from_factors("w", a, g, "math", rank=2, tail="zero")
    values, vectors = torch.linalg.eigh(a)
    best = vectors[:, -2:] @ torch.diag(values[-2:]) @ vectors[:, -2:].T  # Eckart-Young
    assert top.a_vectors.shape == (5, 2) and top.g_vectors.shape == (3, 2)
    assert torch.allclose(dense_factors(top)[0].double(), best, atol=1e-4 * float(a.abs().max()))


def test_rounding_below_zero_is_clipped_but_an_indefinite_or_broken_factor_is_refused():
    low_rank = psd(4, 2, rank=2)  # two eigenvalues are 0 up to rounding
    basis = basis_from_factors("w", low_rank, psd(2, 3), "math")
    assert float(basis.a_values.min()) >= 0
    indefinite = torch.diag(torch.tensor([1.0, -0.5, 2.0]))
    with pytest.raises(AnchorValidationError, match="not positive semi-definite"):
        basis_from_factors("layer.weight", indefinite, psd(2, 3), "math")
    with pytest.raises(AnchorValidationError, match="not symmetric"):
        basis_from_factors("layer.weight", torch.triu(psd(3, 4)), psd(2, 3), "math")
    with pytest.raises(AnchorValidationError, match="NaN/Inf"):
        basis_from_factors("layer.weight", psd(2, 3), torch.full((2, 2), float("nan")), "math")
    with pytest.raises(AnchorValidationError, match="square"):
        basis_from_factors("layer.weight", torch.ones(2, 3), psd(2, 3), "math")


def test_stored_tensors_round_trip_and_corrupt_bases_fail_with_the_weight_named():
    bases = {"a.weight": basis_from_factors("a.weight", psd(3, 5), psd(2, 6), "m")}
    stored = {"a.bias": torch.ones(2), **basis_tensors(bases)}
    assert kfac_weight_names(iter(stored)) == ["a.weight"]
    back = read_bases(stored, "m")["a.weight"]
    assert torch.equal(back.g_vectors, bases["a.weight"].g_vectors)
    broken = dict(stored)
    broken["kfac/a.weight/a_vectors"] = broken["kfac/a.weight/a_vectors"] * 2  # no longer orthonormal
    with pytest.raises(AnchorValidationError, match="'a.weight'.*not orthonormal"):
        read_bases(broken, "m")
    negative = dict(stored)
    negative["kfac/a.weight/g_values"] = -negative["kfac/a.weight/g_values"]
    with pytest.raises(AnchorValidationError, match="negative eigenvalues"):
        read_bases(negative, "m")
    del stored["kfac/a.weight/g_values"]
    with pytest.raises(AnchorValidationError, match="lacks \\['g_values'\\]"):
        read_bases(stored, "m")
    check_basis("a.weight", back, "m")  # a sound basis passes


def test_rotated_weights_are_the_products_then_the_left_out_zeros():
    basis = basis_from_factors("w", psd(4, 7), psd(3, 8), "m", rank=2, tail="zero")
    weights = RotatedWeights([basis], [(3, 4)])
    assert len(weights) == 1
    assert torch.equal(weights[0][:4], torch.outer(basis.g_values, basis.a_values).reshape(-1))
    assert torch.equal(weights[0][4:], torch.zeros(8))
