"""Memory plans (`MemoryPlan`: theta0 in the parameter's dtype, F in float32 or bf16, sparse with offloaded
metrics) against float64 references and hand-counted bytes."""

import math

import pytest
import torch
from torch import nn

from hf_cfp import FisherAnchor
from hf_cfp.errors import CFPArgumentError
from hf_cfp.geometry.diagonal.sparse import coordinate_threshold, mass_threshold
from hf_cfp.protection import CFPState, MemoryPlan, describe_sparse


def bf16_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 4)).to(torch.bfloat16)


def anchor_for(model: nn.Module, name: str = "math", seed: int = 1) -> FisherAnchor:
    g = torch.Generator().manual_seed(seed)
    return FisherAnchor({n: torch.rand(p.shape, generator=g) * 4 for n, p in model.named_parameters()}, name=name)


def nudge(model: nn.Module, seed: int = 2) -> dict[str, torch.Tensor]:
    """Move every parameter by a random step (an optimizer's proposal); return the proposal."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.dtype))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_dense_default_keeps_theta0_in_bf16_and_f_in_float32_six_bytes_per_parameter():
    model = bf16_model()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = CFPState(model, anchor_for(model))
    assert all(t.dtype == torch.bfloat16 for t in state.theta0)
    assert all(torch.equal(t, initial[n]) for n, t in zip(state.names, state.theta0, strict=True))
    assert all(f.dtype == torch.float32 for f in state.views["math"].fisher)
    numel = sum(p.numel() for p in model.parameters())
    assert state.footprint() == (6 * numel, 0)
    bf16 = CFPState(model, anchor_for(model), memory=MemoryPlan(fisher_dtype="bfloat16"))
    assert bf16.footprint() == (4 * numel, 0)


@pytest.mark.parametrize("fisher_dtype", ["float32", "bfloat16"])
def test_dense_correction_and_metrics_against_float64(fisher_dtype):
    model = bf16_model()
    anchor = anchor_for(model)
    theta0 = {n: p.detach().double() for n, p in model.named_parameters()}
    state = CFPState(model, anchor, memory=MemoryPlan(fisher_dtype=fisher_dtype))
    proposal = nudge(model)
    state.correct(3.0)
    stored = {n: f.to(getattr(torch, fisher_dtype)).double() for n, f in anchor.fisher.items()}
    for name, p in model.named_parameters():
        want = theta0[name] + (proposal[name].double() - theta0[name]) / (1 + 3.0 * stored[name])
        assert torch.allclose(p.double(), want, rtol=2**-8, atol=0)  # rounded once to bf16
    metrics = state.drift_metrics()
    deltas = {n: p.double() - theta0[n] for n, p in model.named_parameters()}
    sensitive = sum(float((stored[n] * d**2).sum()) for n, d in deltas.items())
    total = sum(float((d**2).sum()) for d in deltas.values())
    assert metrics["cfp/math/sensitive_drift"] == pytest.approx(math.sqrt(sensitive), rel=1e-6)
    assert metrics["cfp/total_drift"] == pytest.approx(math.sqrt(total), rel=1e-6)


def test_sparse_corrects_the_top_coordinates_only_and_keeps_metrics_exact():
    model, twin = bf16_model(), bf16_model()
    anchor = anchor_for(model)
    theta0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    share = 0.1
    sparse = CFPState(model, anchor, memory=MemoryPlan(sparse=share))
    dense = CFPState(twin, anchor)
    proposal = nudge(model)
    nudge(twin)
    sparse.correct(2.0)
    dense.correct(2.0)
    values = torch.cat([f.reshape(-1) for f in anchor.fisher.values()])
    numel_all = values.numel()
    threshold = float(values.sort().values[math.ceil((1 - share) * values.numel()) - 1])  # by enumeration
    kept = 0
    for (name, p), (_, q) in zip(model.named_parameters(), twin.named_parameters(), strict=True):
        top = anchor.fisher[name] > threshold
        kept += int(top.sum())
        assert torch.equal(p[top], q[top])  # kept coordinates: the dense correction, bit for bit
        assert torch.equal(p[~top], proposal[name][~top])  # the rest: the optimizer's proposal, bit for bit
    assert kept == sparse.sparse_report.kept <= math.ceil(share * values.numel())
    assert kept > 0
    report = sparse.sparse_report
    assert report.mass_kept[0] == pytest.approx(float(values[values > threshold].sum() / values.sum()), rel=1e-6)
    assert report.largest_dropped[0] == float(values[values <= threshold].max())
    line = describe_sparse(report, ["math"], [2.0])
    assert f"correcting {kept:,} of {numel_all:,}" in line and f"lam F = {2.0 * report.largest_dropped[0]:.3g}" in line
    # the metrics run over theta0 and F offloaded (here CPU -> CPU) and equal a float64 loop
    metrics = sparse.drift_metrics()
    total = sum(float(((p.double() - theta0[n].double()) ** 2).sum()) for n, p in model.named_parameters())
    assert metrics["cfp/total_drift"] == pytest.approx(math.sqrt(total), rel=1e-6)
    numel = values.numel()
    index_theta0_f = kept * (4 + 2 + 4)
    assert sparse.footprint() == (index_theta0_f, (2 + 4) * numel)


def test_sparse_by_mass_and_two_anchors_keep_the_union():
    model = bf16_model()
    math_anchor, code_anchor = anchor_for(model, "math", seed=1), anchor_for(model, "code", seed=3)
    state = CFPState(model, [math_anchor, code_anchor], memory=MemoryPlan(sparse=0.5, sparse_by="mass"))
    report = state.sparse_report
    for anchor, t, share in zip((math_anchor, code_anchor), report.thresholds, report.mass_kept, strict=True):
        values = torch.cat([f.reshape(-1) for f in anchor.fisher.values()]).double()
        assert float(values[values > t].sum()) >= 0.5 * float(values.sum())  # holds the mass asked for
        assert share >= 0.5
    union = sum(
        int(((math_anchor.fisher[n] > report.thresholds[0]) | (code_anchor.fisher[n] > report.thresholds[1])).sum())
        for n in math_anchor.fisher
    )
    assert report.kept == union


def test_mass_threshold_is_the_largest_t_holding_the_share_by_enumeration():
    g = torch.Generator().manual_seed(4)
    fisher = [torch.randint(0, 6, (7,), generator=g).float() / 4, torch.rand(9, generator=g), torch.zeros(3)]
    values = torch.cat(fisher).double()
    for share in (0.05, 0.3, 0.5, 0.9, 0.999):
        t = mass_threshold(fisher, share)
        assert float(values[values > t].sum()) >= share * float(values.sum())
        # no larger candidate (any value above t) still holds it: t is the largest such threshold
        larger = values[values > t]
        assert all(float(values[values > c].sum()) < share * float(values.sum()) for c in larger.tolist())
    assert mass_threshold([torch.zeros(4)], 0.5) == math.inf
    assert coordinate_threshold(fisher, 0.25) == float(values.sort().values[math.ceil(0.75 * 19) - 1])


def test_bad_memory_arguments_are_clear_errors():
    with pytest.raises(CFPArgumentError, match="fisher_dtype"):
        MemoryPlan(fisher_dtype="float16")
    with pytest.raises(CFPArgumentError, match="sparse"):
        MemoryPlan(sparse=1.5)
    with pytest.raises(CFPArgumentError, match="sparse_by"):
        MemoryPlan(sparse=0.1, sparse_by="rows")
    model = bf16_model()
    state = CFPState(model, anchor_for(model), memory=MemoryPlan(sparse=0.1))
    with pytest.raises(CFPArgumentError, match="predicted_kl_budget"):
        state.budget_lams([0.1])


def test_a_refreshed_state_adopts_the_theta0_tensors_instead_of_copying_them():
    model = bf16_model()
    state = CFPState(model, anchor_for(model))
    nudge(model)
    again = CFPState(model, anchor_for(model, seed=5), theta0=state.theta0_pieces())
    assert [t.data_ptr() for t in again.theta0] == [t.data_ptr() for t in state.theta0]
