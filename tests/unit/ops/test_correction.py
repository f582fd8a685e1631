"""The correction's tensor math (`proximal_pull_`) against its closed form."""

import math

import pytest
import torch

from hf_cfp.ops import proximal_pull_


def test_proximal_pull_closed_form():
    fisher = [torch.tensor([0.0, 0.5, 2.0, 1e6])]
    p, t0 = torch.tensor([1.0, 1.0, 1.0, 1.0]), torch.zeros(4)
    proximal_pull_([p], [t0], [fisher], [4.0])
    # lerp computes 1 - w in float32: the error is absolute, about one float32 ulp of the step.
    assert torch.allclose(p, 1 / (1 + 4.0 * fisher[0]), rtol=1e-6, atol=2e-7)
    assert math.isclose(p[0].item(), 1.0)


def test_proximal_pull_bf16_chunked_two_anchors_against_float64():
    """bf16 parameters and theta0 (as CFPState keeps them), anchor 0's F in bf16 on both tensors, anchor 1's in
    float32 on the first only: theta0 + (p - theta0) / (1 + P) in float64, rounded once to bf16, within one bf16
    rounding (the float32 compute can land on the other side of a rounding boundary); and elementwise math, so
    cutting the tensors into spans of 1 or 5 elements changes no bit."""
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(4, 6, generator=g).bfloat16(), torch.randn(9, generator=g).bfloat16()]
    theta0 = [(p.float() + torch.randn(p.shape, generator=g)).bfloat16() for p in params]
    fishers = [
        [torch.rand(4, 6, generator=g).bfloat16() * 3, torch.rand(4, 6, generator=g)],
        [torch.rand(9, generator=g).bfloat16(), None],
    ]
    lams = [2.0, 0.5]
    expected = []
    for p, t0, row in zip(params, theta0, fishers, strict=True):
        strength = sum(lam * f.double() for lam, f in zip(lams, row, strict=True) if f is not None)
        expected.append(t0.double() + (p.double() - t0.double()) / (1 + strength))
    results = []
    for chunk in (4096, 1, 5):
        work = [p.clone() for p in params]
        proximal_pull_(work, theta0, fishers, lams, chunk=chunk)
        results.append(work)
    for got, want in zip(results[0], expected, strict=True):
        assert got.dtype == torch.bfloat16
        assert torch.allclose(got.double(), want, rtol=2**-8, atol=0)  # one bf16 ulp (8 significant bits)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other, strict=True))


def test_proximal_pull_leaves_uncovered_coordinates_and_refuses_non_contiguous():
    p, t0 = torch.ones(3), torch.zeros(3)
    proximal_pull_([p], [t0], [[torch.zeros(3)]], [1.0])  # F = 0: the proposal stays, bit for bit
    assert torch.equal(p, torch.ones(3))
    strided = torch.ones(3, 2).t()
    with pytest.raises(ValueError, match="contiguous"):
        proximal_pull_([strided], [torch.zeros(2, 3)], [[torch.ones(2, 3)]], [1.0])
