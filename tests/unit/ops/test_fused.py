"""The fused kernels (`ops.fused`) behind the correction, the drift sums and the KL budget's terms: against float64
closed forms, against the chunked pack path they replace (HF_CFP_COMPILE=0), and the fallback when compiling
fails. Tensors of at least `fused.MIN_ELEMENTS` elements take the kernels; smaller ones stay on the pack path."""

import pytest
import torch

from hf_cfp.ops import DriftView, budget_terms, drift_squares, fused, proximal_pull_

N = fused.MIN_ELEMENTS + 123  # above the kernels' minimum, not a multiple of any vector width


def case(dtype, fisher_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    theta0 = [torch.randn(n, generator=g).to(dtype) for n in (N, 2 * N, 300)]  # the last one: pack path
    params = [(t.float() + torch.randn(t.shape, generator=g)).to(dtype) for t in theta0]
    fishers = [[(torch.rand(t.shape, generator=g) * 3).to(fisher_dtype)] for t in theta0]
    return params, theta0, fishers


@pytest.fixture
def pack_path(monkeypatch):
    """Run the code under test with the kernels switched off (the chunked pack path alone)."""
    monkeypatch.setenv("HF_CFP_COMPILE", "0")


@pytest.mark.parametrize("dtype, fisher_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
def test_pull_is_the_closed_form_and_agrees_with_the_pack_path(dtype, fisher_dtype, monkeypatch):
    params, theta0, fishers = case(dtype, fisher_dtype)
    fused_params = [p.clone() for p in params]
    assert fused.available()
    proximal_pull_(fused_params, theta0, fishers, [0.7])
    monkeypatch.setenv("HF_CFP_COMPILE", "0")
    pack_params = [p.clone() for p in params]
    proximal_pull_(pack_params, theta0, fishers, [0.7])
    # one rounding to the parameter's dtype (bf16: 8 significant bits; float32: a few ulps of the float32 compute,
    # absolute near 0 where the two terms cancel)
    rtol, atol = (2**-7, 1e-6) if dtype == torch.bfloat16 else (1e-6, 1e-6)
    for got, packed, p, t0, (f,) in zip(fused_params, pack_params, params, theta0, fishers, strict=True):
        want = t0.double() + (p.double() - t0.double()) / (1 + 0.7 * f.double())
        assert got.dtype == dtype
        assert torch.allclose(got.double(), want, rtol=rtol, atol=atol)
        assert torch.allclose(got.double(), packed.double(), rtol=rtol, atol=atol)


def test_drift_and_budget_sums_are_the_float64_sums_on_both_paths(monkeypatch):
    params, theta0, fishers = case(torch.bfloat16, torch.float32, seed=1)
    threshold = 1.5
    views = [DriftView([row[0] for row in fishers], threshold)]
    delta = [p.double() - t.double() for p, t in zip(params, theta0, strict=True)]
    f = [row[0].double() for row in fishers]
    want_drift = torch.tensor(
        [
            sum(float(d.square().sum()) for d in delta),
            sum(float((ff * d.square()).sum()) for ff, d in zip(f, delta, strict=True)),
            sum(float(d.square()[ff <= threshold].sum()) for ff, d in zip(f, delta, strict=True)),
        ],
        dtype=torch.float64,
    )
    relief = [1 + 0.4 * ff for ff in f]
    want_budget = torch.tensor(
        [
            [sum(float((0.5 * ff * (d / r).square()).sum()) for ff, d, r in zip(f, delta, relief, strict=True))],
            [-sum(float((ff.square() * d.square() / r**3).sum()) for ff, d, r in zip(f, delta, relief, strict=True))],
        ],
        dtype=torch.float64,
    )
    found = [(drift_squares(params, theta0, views), budget_terms(params, theta0, fishers, [0.4]))]
    monkeypatch.setenv("HF_CFP_COMPILE", "0")
    found.append((drift_squares(params, theta0, views), budget_terms(params, theta0, fishers, [0.4])))
    for drift, budget in found:  # fused, then the pack path
        assert torch.allclose(drift, want_drift, rtol=1e-6)
        assert torch.allclose(budget, want_budget, rtol=1e-6)


def test_a_tensor_no_view_covers_is_summed_by_the_square_kernel():
    g = torch.Generator().manual_seed(2)
    theta0 = torch.randn(N, generator=g)
    param = theta0 + torch.randn(N, generator=g)
    sums = drift_squares([param], [theta0], [DriftView([None], 0.5)])
    assert float(sums[0]) == pytest.approx(float((param.double() - theta0.double()).square().sum()), rel=1e-6)
    assert float(sums[1]) == 0 and float(sums[2]) == 0


def test_a_failed_compilation_falls_back_to_the_pack_path_and_says_so_once(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler here")

    monkeypatch.setattr(fused, "_KERNELS", {})
    monkeypatch.setattr(fused, "_STATE", {"failed": False})
    monkeypatch.setattr(fused.torch, "compile", broken)
    params, theta0, fishers = case(torch.float32, torch.float32, seed=3)
    want = [t0 + (p - t0) / (1 + 2.0 * row[0]) for p, t0, row in zip(params, theta0, fishers, strict=True)]
    with caplog.at_level("WARNING"):
        proximal_pull_(params, theta0, fishers, [2.0])
        proximal_pull_([p.clone() for p in params], theta0, fishers, [0.0])
    assert not fused.available()
    assert sum("could not be compiled" in r.message for r in caplog.records) == 1
    for got, expected in zip(params, want, strict=True):
        assert torch.allclose(got, expected, rtol=1e-6)
