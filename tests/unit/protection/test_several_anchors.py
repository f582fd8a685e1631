"""Several protecting anchors: one pass of the summed proximal step theta0 + Delta / (1 + sum_k lam_k F_k),
against a float64 reference per parameter, with per-anchor metrics; and the lams of a KL budget on a model."""

import pytest
import torch
from support.tiny import anchor_for, tiny_llama

from hf_cfp import FisherAnchor
from hf_cfp.errors import CFPArgumentError
from hf_cfp.protection import CFPState


def partial_anchor(model, name, every=2, seed=1):
    """F of uniform random values on every `every`-th parameter only."""
    g = torch.Generator().manual_seed(seed)
    named = list(model.named_parameters())[::every]
    return FisherAnchor({n: 3 * torch.rand(p.shape, generator=g) for n, p in named}, name=name)


def propose(model, seed=0, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))


def test_several_anchors_take_one_summed_proximal_step():
    model = tiny_llama()
    math_anchor, code_anchor = anchor_for(model, "math"), partial_anchor(model, "code")
    theta0 = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    state = CFPState(model, [math_anchor, code_anchor])
    propose(model)
    proposal = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    state.correct([1.0, 10.0])
    for n, p in model.named_parameters():
        pull = 1.0 * math_anchor.fisher[n].double()
        if n in code_anchor.fisher:
            pull = pull + 10.0 * code_anchor.fisher[n].double()
        expected = theta0[n] + (proposal[n] - theta0[n]) / (1 + pull)
        torch.testing.assert_close(p.double(), expected, rtol=1e-6, atol=1e-7)


def test_summed_step_is_not_two_corrections_in_sequence():
    """Sequential corrections would give Delta / ((1 + F1)(1 + F2)); the summed step Delta / (1 + F1 + F2)."""
    model = tiny_llama()
    ones = {n: torch.ones(p.shape) for n, p in model.named_parameters()}
    state = CFPState(model, [FisherAnchor(ones, name="a"), FisherAnchor(dict(ones), name="b")])
    theta0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    propose(model)
    proposal = {n: p.detach().clone() for n, p in model.named_parameters()}
    state.correct([1.0, 1.0])
    for n, p in model.named_parameters():
        torch.testing.assert_close(p - theta0[n], (proposal[n] - theta0[n]) / 3)


def test_metrics_per_anchor_and_the_lams_of_the_last_step():
    model = tiny_llama()
    math_anchor, code_anchor = anchor_for(model, "math"), partial_anchor(model, "code")
    watch = anchor_for(model, "w", seed=3)
    state = CFPState(model, [math_anchor, code_anchor], monitors=[watch])
    theta0 = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    propose(model)
    state.correct([2.0, 0.5])
    metrics = state.drift_metrics()
    assert metrics["cfp/math/lam"] == 2.0 and metrics["cfp/code/lam"] == 0.5 and "cfp/w/lam" not in metrics
    for anchor in (math_anchor, code_anchor, watch):
        sensitive_sq = sum(
            float((f.double() * (dict(model.named_parameters())[n].double() - theta0[n]) ** 2).sum())
            for n, f in anchor.fisher.items()
        )
        assert metrics[f"cfp/{anchor.name}/sensitive_drift"] ** 2 == pytest.approx(sensitive_sq, rel=1e-6)
        assert metrics[f"cfp/{anchor.name}/predicted_kl"] == pytest.approx(sensitive_sq / 2, rel=1e-6)


def test_a_wrong_number_of_lams_is_refused():
    model = tiny_llama()
    state = CFPState(model, [anchor_for(model, "math"), partial_anchor(model, "code")])
    with pytest.raises(CFPArgumentError, match="2 protecting anchors"):
        state.correct([1.0])


def test_budget_lams_hold_each_budget_on_the_model():
    model = tiny_llama()
    math_anchor, code_anchor = anchor_for(model, "math"), partial_anchor(model, "code")
    state = CFPState(model, [math_anchor, code_anchor])
    propose(model)
    before = state.drift_metrics()
    budgets = [0.1 * before["cfp/math/predicted_kl"], 0.05 * before["cfp/code/predicted_kl"]]
    lams = state.budget_lams(budgets)
    state.correct(lams)
    after = state.drift_metrics()
    for name, budget, lam in zip(("math", "code"), budgets, lams, strict=True):
        assert after[f"cfp/{name}/predicted_kl"] <= budget * (1 + 1e-5)
        assert lam == 0 or after[f"cfp/{name}/predicted_kl"] >= 0.99 * budget * (1 - 1e-5)
