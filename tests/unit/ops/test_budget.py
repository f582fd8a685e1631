"""The KL budget's math (`ops.budget`): the predicted KL and its slope against a float64 loop, and the solved lams
against the budget rules and the KKT conditions of the projection they stand for."""

import math

import pytest
import torch

from hf_cfp import CFPError
from hf_cfp.ops import budget_terms, solve_budget


def problem(seed=0, sizes=(50, 30), anchors=2):
    """Proposal displacements D (theta0 = 0) on two tensors and F of `anchors` anchors, anchor 1 covering only
    the first tensor; F spans four decades, like a real anchor's."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=g) * 0.1 for n in sizes]
    theta0 = [torch.zeros(n) for n in sizes]
    fishers = [
        [10 ** (4 * torch.rand(n, generator=g) - 2) if k == 0 or i == 0 else None for k in range(anchors)]
        for i, n in enumerate(sizes)
    ]
    return params, theta0, fishers


def reference_kl(params, theta0, fishers, lams):
    """0.5 sum_i F_ki D_i^2 / (1 + sum_j lam_j F_ji)^2 per anchor k, one coordinate at a time, float64."""
    kl = [0.0] * len(lams)
    for p, t0, row in zip(params, theta0, fishers, strict=True):
        for i in range(p.numel()):
            d = float(p[i]) - float(t0[i])
            pull = sum(lam * float(f[i]) for lam, f in zip(lams, row, strict=True) if f is not None)
            for k, f in enumerate(row):
                if f is not None:
                    kl[k] += 0.5 * float(f[i]) * d * d / (1 + pull) ** 2
    return kl


def test_terms_match_a_float64_loop_and_the_slope_a_finite_difference():
    params, theta0, fishers = problem()
    lams = [0.3, 2.0]
    terms = budget_terms(params, theta0, fishers, lams)
    assert terms[0].tolist() == pytest.approx(reference_kl(params, theta0, fishers, lams), rel=1e-5)
    for k in range(2):
        h = 1e-4 * lams[k]
        up = reference_kl(params, theta0, fishers, [lam + h * (j == k) for j, lam in enumerate(lams)])[k]
        down = reference_kl(params, theta0, fishers, [lam - h * (j == k) for j, lam in enumerate(lams)])[k]
        assert float(terms[1, k]) == pytest.approx((up - down) / (2 * h), rel=1e-4)


def evaluate_on(params, theta0, fishers):
    calls = []

    def evaluate(lams):
        calls.append(list(lams))
        return budget_terms(params, theta0, fishers, lams)

    return evaluate, calls


def bisect_root(kl_of, budget):
    """lam with kl_of(lam) = budget, by 200 bisections in log space (kl_of decreasing)."""
    low, high = 1e-12, 1e12
    for _ in range(200):
        mid = math.sqrt(low * high)
        low, high = (mid, high) if kl_of(mid) > budget else (low, mid)
    return math.sqrt(low * high)


@pytest.mark.parametrize("share", [0.5, 0.05, 1e-4])
def test_one_anchor_lands_in_the_budget_band_around_the_exact_root(share):
    params, theta0, fishers = problem(anchors=1)
    kl0 = reference_kl(params, theta0, fishers, [0.0])[0]
    budget = share * kl0
    evaluate, calls = evaluate_on(params, theta0, fishers)
    (lam,) = solve_budget(evaluate, [budget], [0.0], tolerance=0.01)
    kl = reference_kl(params, theta0, fishers, [lam])[0]
    assert 0.99 * budget <= kl <= budget * (1 + 1e-6)
    # between the exact roots of KL = budget and KL = 0.99 budget (KL decreasing in lam)
    kl_at = lambda x: reference_kl(params, theta0, fishers, [x])[0]  # noqa: E731
    assert bisect_root(kl_at, budget) * (1 - 1e-6) <= lam <= bisect_root(kl_at, 0.99 * budget) * (1 + 1e-6)
    assert len(calls) <= 12, calls  # Newton in log-log: a handful of passes


def test_inside_the_budget_lam_is_zero_and_one_pass_decides_it():
    params, theta0, fishers = problem(anchors=1)
    kl0 = reference_kl(params, theta0, fishers, [0.0])[0]
    evaluate, calls = evaluate_on(params, theta0, fishers)
    assert solve_budget(evaluate, [1.01 * kl0], [0.0]) == [0.0]
    assert calls == [[0.0]]


def test_a_warm_start_far_above_the_root_comes_down_and_a_path_back_inside_releases_the_pull():
    params, theta0, fishers = problem(anchors=1)
    kl0 = reference_kl(params, theta0, fishers, [0.0])[0]
    evaluate, _ = evaluate_on(params, theta0, fishers)
    (lam,) = solve_budget(evaluate, [0.1 * kl0], [1e6])
    assert 0.099 * kl0 <= reference_kl(params, theta0, fishers, [lam])[0] <= 0.1 * kl0
    assert solve_budget(evaluate, [2 * kl0], [lam]) == [0.0]  # over-protecting start: no pull needed at all


def test_two_anchors_satisfy_the_kkt_conditions_of_the_projection():
    """minimize ||Delta - D||^2 s.t. 0.5 Delta^T F_k Delta <= B_k: Delta = D / (1 + sum lam_k F_k) with lam >= 0,
    every KL_k <= B_k, and lam_k > 0 only where KL_k is at its budget (here within the 1% band)."""
    params, theta0, fishers = problem()
    kl0 = reference_kl(params, theta0, fishers, [0.0, 0.0])
    for budgets in ([0.05 * kl0[0], 0.2 * kl0[1]], [0.3 * kl0[0], 0.01 * kl0[1]], [0.01 * kl0[0], 2 * kl0[1]]):
        evaluate, _ = evaluate_on(params, theta0, fishers)
        lams = solve_budget(evaluate, budgets, [0.0, 0.0])
        kl = reference_kl(params, theta0, fishers, lams)
        for k in range(2):
            assert lams[k] >= 0
            assert kl[k] <= budgets[k] * (1 + 1e-6)
            assert lams[k] == 0 or kl[k] >= 0.99 * budgets[k], (budgets, lams, kl)
        # a budget the other anchor's pull already meets gets no pull of its own
        if budgets[1] > kl0[1]:
            assert lams[1] == 0


def test_a_budget_the_correction_cannot_reach_is_a_clear_error():
    params, theta0, fishers = problem(anchors=1)
    fishers[0][0] = fishers[0][0].clone()
    fishers[0][0][0] = math.nan
    evaluate, _ = evaluate_on(params, theta0, fishers)
    with pytest.raises(CFPError, match="predicted_kl_budget"):
        solve_budget(evaluate, [1e-6], [0.0])
