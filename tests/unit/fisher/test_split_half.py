"""estimate_fisher's split-half reliability (`metadata["split_half"]`) against a plain per-sequence loop.

The reference draws the same responses (the sampler's per-batch streams, as test_estimate.py does), scores
every sequence with one plain forward and torch.autograd.grad in float64 (`ref_sequence_score`), sums the
squares of sequences n < N/2 and n >= N/2 apart, and takes the top-1% sets with a Python sort.
"""

import math

import pytest
import torch
from support.references import ref_sequence_score
from support.tiny import tiny_llama

from hf_cfp import FisherAnchor, estimate_fisher
from hf_cfp.fisher.sampling import Sampler, batch_generator, sample_responses

PROMPTS = [[1, 2, 3, 4], [6], [7, 8]]
N, BATCH, NEW = 10, 4, 4  # the first half is sequences 0..4: batch 1 (sequences 4..7) straddles it


def estimate(model, **kwargs):
    options = dict(num_sequences=N, max_new_tokens=NEW, batch_size=BATCH, seed=3, show_progress=False)
    return estimate_fisher(model, None, PROMPTS, **{**options, **kwargs})


def squared_terms(model, prompt, response, estimator):
    """The flat float64 per-sequence term: g^2 (sequence), or sum_t xi_t^2 with xi_t the score of the single
    token y_t after x + y_<t (token)."""
    pieces = (
        [(prompt, response)]
        if estimator == "sequence"
        else [(prompt + response[:t], [response[t]]) for t in range(len(response))]
    )
    total = None
    for p, r in pieces:
        square = torch.cat([g.reshape(-1) for g in ref_sequence_score(model, p, r)]) ** 2
        total = square if total is None else total + square
    return total


def top_set(values, k):
    return set(sorted(range(len(values)), key=lambda i: (-values[i], i))[:k])


def reference(model, estimator, seed=3):
    """(S_a, S_b, N_a): the summed per-sequence terms of each half, on the draws estimate_fisher makes."""
    model.eval()
    sums, half = [None, None], math.ceil(N / 2)
    for k in range(math.ceil(N / BATCH)):
        indices = range(k * BATCH, min((k + 1) * BATCH, N))
        prompts = [PROMPTS[n % len(PROMPTS)] for n in indices]
        drawn = sample_responses(model, prompts, Sampler(), NEW, set(), 0, batch_generator(seed, k))
        for n, prompt, response in zip(indices, prompts, drawn, strict=True):
            term = squared_terms(model, prompt, response, estimator)
            which = 0 if n < half else 1
            sums[which] = term if sums[which] is None else sums[which] + term
    return sums[0], sums[1], half


@pytest.mark.parametrize("estimator, engine", [("sequence", "batched"), ("sequence", "loop"), ("token", "batched")])
def test_split_half_equals_a_plain_per_sequence_loop(estimator, engine):
    model = tiny_llama(vocab_size=24, seed=3)
    anchor = estimate(model, estimator=estimator, engine=engine)
    s_a, s_b, n_a = reference(model, estimator)
    n = s_a.numel()
    k = math.ceil(0.01 * n)
    for s in (s_a, s_b):  # the sets are well separated: float32 accumulation cannot reorder them
        ordered = s.sort(descending=True).values
        assert float(ordered[k - 1] - ordered[k]) > 1e-4 * float(ordered[k - 1])
    overlap = len(top_set(s_a.tolist(), k) & top_set(s_b.tolist(), k)) / k
    mass_a, mass_b = float(s_a.sum()) / n_a, float(s_b.sum()) / (N - n_a)
    split = anchor.metadata["split_half"]
    print(f"{estimator}/{engine}: n={n}, k={k}, overlap {overlap:.3f}, masses {mass_a:.4g} / {mass_b:.4g}")
    assert 0 < overlap < 1  # a test that could see a wrong split
    assert split["top1pct_overlap"] == overlap
    assert split["mass_relative_difference"] == pytest.approx(abs(mass_a - mass_b) / ((mass_a + mass_b) / 2), rel=1e-5)
    assert split["num_sequences"] == [5, 5]
    flat = torch.cat([t.reshape(-1) for t in anchor.fisher.values()]).double()  # and F = (S_a + S_b) / N
    torch.testing.assert_close(flat, (s_a + s_b) / N, rtol=1e-5, atol=1e-7 * float(flat.max()))


def test_split_half_is_deterministic_given_the_seed_and_survives_a_save(tmp_path):
    model = tiny_llama(vocab_size=24, seed=4)
    first, second, other = estimate(model), estimate(model), estimate(model, seed=4)
    assert first.metadata["split_half"] == second.metadata["split_half"]
    assert first.metadata["split_half"] != other.metadata["split_half"]
    first.save_pretrained(tmp_path)
    assert FisherAnchor.from_pretrained(tmp_path).metadata["split_half"] == first.metadata["split_half"]


def test_split_half_needs_two_sequences_and_gives_odd_n_the_extra_one_first():
    model = tiny_llama(vocab_size=24, seed=5)
    assert estimate(model, num_sequences=1).metadata["split_half"] is None
    assert estimate(model, num_sequences=2).metadata["split_half"]["num_sequences"] == [1, 1]
    empirical = estimate(model, num_sequences=5, estimator="empirical", responses=[[9, 10], [11], [12, 13, 14]])
    assert empirical.metadata["split_half"]["num_sequences"] == [3, 2]
