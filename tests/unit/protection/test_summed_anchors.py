"""Several protecting anchors on the same K-FAC weights: CFPState's correction is the exact proximal map of the
summed penalty, against a dense float64 solve of (I + sum_k lam_k kron(G_k, A_k) + diag(sum_j lam_j F_j)) vec(D)
on every factored weight and D / (1 + sum_k lam_k F_k) elsewhere, for two and three anchors (K-FAC + K-FAC, K-FAC +
diagonal, full rank and truncated with tails); the drift metrics stay per anchor (the dense quadratics); what has
no exact form is refused with what to do."""

import math

import pytest
import torch
from support.anchors import small_estimate
from support.tiny import tiny_llama

from hf_cfp import FisherAnchor
from hf_cfp.errors import AnchorValidationError, CFPArgumentError
from hf_cfp.geometry.kronecker.artifact import dense_factors
from hf_cfp.names import SENSITIVE_DRIFT, SUMMED_ITERATIONS
from hf_cfp.protection import CFPState

PROMPTS = {"math": [[1, 2, 3], [4, 5, 6, 7]], "safety": [[9, 8], [7, 6, 5]], "code": [[11, 3, 5]]}


def model_and_anchors(specs, seed=5):
    """A tiny Llama and one anchor per (name, structure, rank)."""
    model = tiny_llama(vocab_size=40, hidden_size=16, layers=1, seed=seed)
    anchors = [
        small_estimate(model, PROMPTS[name], name, structure, rank, seed=k)
        for k, (name, structure, rank) in enumerate(specs)
    ]
    return model, anchors


def propose(model, seed=0, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    theta0 = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return theta0, {n: p.detach().double().clone() for n, p in model.named_parameters()}


def dense_penalty(anchors, lams, name, shape):
    """sum_k lam_k K_k on parameter `name` (n x n, float64): kron(G, A) for a factored weight, diag(F) otherwise."""
    size = math.prod(shape)
    total = torch.zeros(size, size, dtype=torch.float64)
    for anchor, lam in zip(anchors, lams, strict=True):
        if name in anchor.kfac:
            a, g = dense_factors(anchor.kfac[name])
            total += lam * torch.kron(g.double(), a.double())
        elif name in anchor.fisher:
            total += lam * torch.diag(anchor.fisher[name].double().reshape(-1))
    return total


SETS = {
    "kfac+kfac": [("math", "kfac", None), ("safety", "kfac", None)],
    "kfac+kfac tails": [("math", "kfac", 3), ("safety", "kfac", 3)],
    "kfac+diagonal": [("math", "kfac", 3), ("safety", "diagonal", None)],
    "three": [("math", "kfac", None), ("safety", "kfac", 3), ("code", "diagonal", None)],
}


@pytest.mark.parametrize("which", list(SETS))
def test_correction_is_the_dense_solve_of_the_summed_penalty(which):
    model, anchors = model_and_anchors(SETS[which])
    lams = [30.0, 8.0, 3.0][: len(anchors)]
    state = CFPState(model, anchors)
    factored = {name for anchor in anchors for name in anchor.kfac}
    assert sorted(t.name for t in state.summed.tensors) == sorted(factored)
    theta0, proposal = propose(model)
    state.correct(lams)
    for name, param in model.named_parameters():
        d = (proposal[name] - theta0[name]).reshape(-1)
        system = torch.eye(len(d), dtype=torch.float64) + dense_penalty(anchors, lams, name, param.shape)
        want = torch.linalg.solve(system, d)
        got = param.detach().double().reshape(-1) - theta0[name].reshape(-1)
        # the solve stops at relative residual 1e-5 (float32 weights), and the system is >= I, so |error| <=
        # |residual| <= 1e-5 |D| (twice that for the recursive residual's drift and float32 rounding)
        assert float((got - want).norm()) <= 2e-5 * float(d.norm()), name
        if not any(name in a.kfac for a in anchors):  # the diagonal formula, elementwise
            assert torch.allclose(got, want, atol=1e-7, rtol=1e-5), name
    metrics = state.drift_metrics()
    assert metrics[SUMMED_ITERATIONS.key()] >= 1
    for anchor in anchors:  # per anchor: its own quadratic over every parameter it covers
        quadratic = 0.0
        for name, param in model.named_parameters():
            delta = (param.detach().double() - theta0[name]).reshape(-1)
            quadratic += float(delta @ dense_penalty([anchor], [1.0], name, param.shape) @ delta)
        assert metrics[SENSITIVE_DRIFT.key(anchor.name)] == pytest.approx(math.sqrt(quadratic), rel=1e-5)


def test_one_protecting_anchor_per_weight_keeps_the_closed_form():
    """A K-FAC protector with a K-FAC monitor: no summed solve, the monitor only measured."""
    model, (math_anchor, safety) = model_and_anchors(SETS["kfac+kfac tails"])
    state = CFPState(model, math_anchor, monitors=[safety])
    assert not state.summed and SUMMED_ITERATIONS.key() not in state.drift_metrics()


def test_the_predicted_kl_budget_is_refused_with_what_to_do():
    model, anchors = model_and_anchors(SETS["kfac+diagonal"])
    state = CFPState(model, anchors)
    propose(model)
    with pytest.raises(CFPArgumentError, match="kl_budget"):
        state.budget_lams([0.1, 0.1])


def test_an_anchor_with_a_diagonal_and_factors_for_one_weight_is_refused():
    model, (anchor,) = model_and_anchors([("math", "kfac", None)])
    name = anchor.kfac_names[0]
    fisher = {**anchor.fisher, name: torch.ones(dict(model.named_parameters())[name].shape)}
    with pytest.raises(AnchorValidationError, match="both a diagonal F and Kronecker factors"):
        FisherAnchor(fisher, name="mixed", kfac=dict(anchor.kfac))
