"""The drift metrics' tensor math (hf_cfp/ops/drift.py) against values computed by hand.

Every delta and Fisher value below is a small dyadic number, so each expected sum is exact; the
sums are accumulated in float64 from float32 squares, hence `rel=1e-6`. The
free-drift cases are chosen so that the coordinate(s) exactly at the threshold carry a large part
of the sum: counting them as not free (`F < threshold`) changes the result by 25% or more.
"""

import math

import pytest
import torch
from torch import nn

from hf_cfp import FisherAnchor
from hf_cfp.ops import DriftView, drift_squares, free_threshold
from hf_cfp.protection import CFPState

REL = 1e-6


def total_drift_sq(deltas):
    return float(drift_squares(deltas, [None] * len(deltas), [])[0])


def sensitive_drift_sq(deltas, fisher):
    return float(drift_squares(deltas, [None] * len(deltas), [DriftView(fisher, -1.0)])[1])


def free_drift_sq(deltas, fisher, threshold):
    return float(drift_squares(deltas, [None] * len(deltas), [DriftView(fisher, threshold)])[2])


# Two tensors, n = 8 coordinates. Sorted F: 0, 0.25, 0.5, 1, 2, 2, 4, 8 (a tie at 2).
DELTAS = [torch.tensor([1.0, -2.0, 3.0, 0.5]), torch.tensor([[4.0, -1.0], [2.0, 0.25]])]
FISHER = [torch.tensor([0.5, 2.0, 0.0, 8.0]), torch.tensor([[1.0, 0.25], [2.0, 4.0]])]
# F * d^2 per coordinate: 0.5, 8, 0, 2 | 16, 0.25, 8, 0.25        -> 35
# d^2 per coordinate:     1,   4, 9, 0.25 | 16, 1,   4, 0.0625    -> 35.3125
SENSITIVE_SQ = 35.0
TOTAL_SQ = 35.3125


def test_sensitive_and_total_drift_exact():
    assert sensitive_drift_sq(DELTAS, FISHER) == pytest.approx(SENSITIVE_SQ, rel=REL)
    assert total_drift_sq(DELTAS) == pytest.approx(TOTAL_SQ, rel=REL)
    # the sums do not depend on how the coordinates are split into tensors
    flat_d = [torch.cat([d.reshape(-1) for d in DELTAS])]
    flat_f = [torch.cat([f.reshape(-1) for f in FISHER])]
    assert sensitive_drift_sq(flat_d, flat_f) == pytest.approx(SENSITIVE_SQ, rel=REL)
    assert total_drift_sq(flat_d) == pytest.approx(TOTAL_SQ, rel=REL)


def test_empty_inputs_give_zero():
    assert sensitive_drift_sq([], []) == 0.0
    assert free_drift_sq([], [], 1.0) == 0.0
    assert total_drift_sq([]) == 0.0


@pytest.mark.parametrize(
    "threshold, expected",
    [
        # F <= 1: F = 0.5 (d 1), 0 (d 3), 1 (d 4), 0.25 (d -1). The coordinate AT the threshold
        # (F = 1, d = 4, d^2 = 16) is free: without it the sum would be 11.
        (1.0, 1 + 9 + 16 + 1),
        # F <= 2: both tied coordinates at F = 2 (d -2 and d 2) are free: without them 27.
        (2.0, 27 + 4 + 4),
        # F <= 0: the one coordinate with F = 0 (d 3) is free: without it 0.
        (0.0, 9.0),
        (8.0, TOTAL_SQ),  # the largest F: every coordinate is free
        (-1.0, 0.0),  # below every F: none is
        (1.5, 27.0),  # between two F values: the same set as at 1
    ],
)
def test_free_drift_counts_coordinates_at_the_threshold(threshold, expected):
    assert free_drift_sq(DELTAS, FISHER, threshold) == pytest.approx(expected, rel=REL, abs=1e-12)


@pytest.mark.parametrize(
    "free_fraction, k, threshold",
    [
        (0.0, 1, 0.0),  # k = max(1, ceil(0)) = 1: the smallest F
        (1e-9, 1, 0.0),  # ceil of a tiny positive product is 1
        (0.125, 1, 0.0),  # 0.125 * 8 = 1 exactly: k = 1, not 2
        (0.126, 2, 0.25),  # 1.008: rounds up to 2
        (0.25, 2, 0.25),
        (0.5, 4, 1.0),  # 4 exactly
        (0.51, 5, 2.0),  # 4.08 -> 5: the first of the two tied 2s
        (0.75, 6, 2.0),  # 6 exactly: the second of the tied 2s
        (0.76, 7, 4.0),
        (0.99, 8, 8.0),  # 7.92 -> 8: the largest F
        (1.0, 8, 8.0),
    ],
)
def test_free_threshold_is_the_kth_smallest_f_with_k_ceil(free_fraction, k, threshold):
    assert math.ceil(free_fraction * 8) == k or (free_fraction == 0.0 and k == 1)  # the table's own k
    assert sorted(float(v) for f in FISHER for v in f.reshape(-1))[k - 1] == threshold
    assert free_threshold(FISHER, free_fraction) == threshold


def test_free_threshold_with_ties_counts_every_tied_coordinate_as_free():
    """free_fraction = 0.51 gives k = 5: the threshold is the first 2, and both coordinates with F = 2
    count as free, 6 of 8 coordinates (the documented 'slightly more than free_fraction' with ties)."""
    threshold = free_threshold(FISHER, 0.51)
    assert threshold == 2.0
    free = sum(int((f <= threshold).sum()) for f in FISHER)
    assert free == 6
    assert free_drift_sq(DELTAS, FISHER, threshold) == pytest.approx(35.0, rel=REL)


def bf16_stored(values):
    """Values as an anchor saved with dtype="bfloat16" holds them after loading (float32 of bf16)."""
    return torch.tensor(values, dtype=torch.float32).bfloat16().float()


def test_bf16_stored_fisher_ties_at_the_threshold_are_all_free():
    """bf16 keeps 8 significant bits: 1.000e-3, 1.001e-3 and 1.002e-3 are one value once stored.
    Three coordinates sit exactly at the threshold; all three count as free."""
    fisher = [bf16_stored([1.0e-3, 5.0, 1.001e-3]), bf16_stored([1.002e-3, 0.5, 2.0])]
    assert float(fisher[0][0]) == float(fisher[0][2]) == float(fisher[1][0]) != 1.0e-3  # three ties
    deltas = [torch.tensor([1.0, 8.0, 2.0]), torch.tensor([4.0, 0.5, 0.25])]
    # n = 6, free_fraction = 1/3 -> k = 2: the threshold is the tied value, bit for bit
    threshold = free_threshold(fisher, 1 / 3)
    assert threshold == float(fisher[0][0])
    # the three tied coordinates (d 1, 2, 4): 1 + 4 + 16 = 21 (strictly below: none, 0)
    assert free_drift_sq(deltas, fisher, threshold) == pytest.approx(21.0, rel=REL)
    # the same with the F tensors kept in bfloat16 (the comparison then runs in bfloat16)
    as_bf16 = [f.bfloat16() for f in fisher]
    assert free_threshold(as_bf16, 1 / 3) == threshold
    assert free_drift_sq(deltas, as_bf16, threshold) == pytest.approx(21.0, rel=REL)
    # the next threshold up (k = 4: 0.5, bf16 exact) adds its coordinate (d 0.5)
    assert free_threshold(fisher, 4 / 6) == 0.5
    assert free_drift_sq(deltas, fisher, 0.5) == pytest.approx(21.25, rel=REL)


def test_cfp_state_metrics_with_a_bf16_stored_anchor(tmp_path):
    """End to end: an anchor saved in bfloat16 and loaded back, bound by CFPState, which takes the
    threshold from the anchor's F and compares the bound (float32) F against it."""
    model = nn.Linear(3, 2)  # weight (2, 3), bias (2,)
    fisher = {
        "weight": torch.tensor([[1.0e-3, 3.0, 1.001e-3], [0.25, 1.002e-3, 7.0]]),
        "bias": torch.tensor([1.003e-3, 0.5]),
    }
    FisherAnchor(fisher, name="math").save_pretrained(tmp_path / "anchor", dtype="bfloat16")
    anchor = FisherAnchor.from_pretrained(tmp_path / "anchor")
    tied = float(anchor.fisher["weight"][0, 0])
    assert [float(anchor.fisher["weight"][0, 2]), float(anchor.fisher["weight"][1, 1])] == [tied, tied]
    assert float(anchor.fisher["bias"][0]) == tied  # four coordinates share the smallest F

    with torch.no_grad():  # theta0 = 0, so theta - theta0 is the delta added below, exactly
        model.weight.zero_()
        model.bias.zero_()
    # n = 8, free_fraction = 0.25 -> k = 2: the threshold is the tied value
    state = CFPState(model, anchor, free_fraction=0.25)
    d_weight = torch.tensor([[1.0, -2.0, 2.0], [0.5, -4.0, 1.0]])
    d_bias = torch.tensor([2.0, 3.0])
    with torch.no_grad():
        model.weight.add_(d_weight)
        model.bias.add_(d_bias)
    metrics = state.drift_metrics()
    f_w, f_b = anchor.fisher["weight"].double(), anchor.fisher["bias"].double()
    sensitive = float((f_w * d_weight.double() ** 2).sum() + (f_b * d_bias.double() ** 2).sum())
    # free: the four tied coordinates, d = 1, 2, -4 (weight) and 2 (bias): 1 + 4 + 16 + 4 = 25
    # total: 1 + 4 + 4 + 0.25 + 16 + 1 + 4 + 9 = 39.25
    assert metrics["cfp/math/free_drift"] == pytest.approx(math.sqrt(25.0), rel=1e-6)
    assert metrics["cfp/math/sensitive_drift"] == pytest.approx(math.sqrt(sensitive), rel=1e-6)
    assert metrics["cfp/total_drift"] == pytest.approx(math.sqrt(39.25), rel=1e-6)


@pytest.mark.parametrize("chunk", [1, 3, 4096])
def test_drift_squares_against_a_float64_loop(chunk):
    """Random parameters and theta0 in bf16 (theta0 as CFPState keeps it for a bf16 model), two views of which
    one covers only the first tensor, F in bf16 and float32: every sum against a float64 loop over coordinates,
    whatever the chunk size (spans cut tensors of 12 and 7 elements into pieces)."""
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(3, 4, generator=g).bfloat16(), torch.randn(7, generator=g).bfloat16()]
    theta0 = [(p.float() + 0.1 * torch.randn(p.shape, generator=g)).bfloat16() for p in params]
    fisher_a = [torch.rand(3, 4, generator=g), torch.rand(7, generator=g).bfloat16()]
    fisher_b = [torch.rand(3, 4, generator=g), None]
    views = [DriftView(fisher_a, 0.5), DriftView(fisher_b, 0.25)]
    got = drift_squares(params, theta0, views, chunk=chunk).tolist()

    deltas = [(p.double() - t.double()).reshape(-1) for p, t in zip(params, theta0, strict=True)]
    expected = [sum(float(d.square().sum()) for d in deltas)]
    for view in views:
        sensitive = free = 0.0
        for d, f in zip(deltas, view.fishers, strict=True):
            if f is not None:
                for di, fi in zip(d.tolist(), f.double().reshape(-1).tolist(), strict=True):
                    sensitive += fi * di * di
                    free += di * di if fi <= view.threshold else 0.0
        expected += [sensitive, free]
    assert got == pytest.approx(expected, rel=1e-6)
