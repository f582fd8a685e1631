"""The sampler's distribution (`Sampler.log_probs`) against plain Python and against transformers'
own logits warpers, and its gradient: the score of the truncated distribution."""

import itertools

import pytest
import torch
from support.references import py_sampler_probs

from hf_cfp.fisher.sampling import Sampler, pack_support, unpack_support

SAMPLER_SETTINGS = [
    (1.0, None, 1.0),
    (0.7, None, 1.0),
    (1.5, None, 1.0),
    (1.0, 3, 1.0),
    (1.0, 1, 1.0),
    (1.0, None, 0.3),
    (1.0, None, 0.9),
    (0.5, None, 0.6),
    (1.3, 5, 0.6),
    (0.8, 2, 0.95),
    (1.0, None, 1e-6),
]


@pytest.mark.parametrize("temperature,top_k,top_p", SAMPLER_SETTINGS)
def test_sampler_log_probs_match_plain_python(temperature, top_k, top_p):
    generator = torch.Generator().manual_seed(1234)
    logits = 2.5 * torch.randn(2, 16, 11, generator=generator)  # any leading shape
    log_probs = Sampler(temperature, top_k, top_p).log_probs(logits)
    assert log_probs.shape == logits.shape
    truncated = top_k is not None or top_p < 1
    for index in itertools.product(range(2), range(16)):
        reference = torch.tensor(py_sampler_probs(logits[index].tolist(), temperature, top_k, top_p))
        got = log_probs[index]
        assert torch.equal(torch.isneginf(got), reference == 0), (index, got, reference)
        torch.testing.assert_close(got.exp().double(), reference.double(), rtol=1e-5, atol=1e-6)
        if top_k is not None:
            assert int((reference > 0).sum()) <= top_k
    if truncated and top_p < 1e-3:
        assert torch.equal(log_probs.argmax(-1), logits.argmax(-1))
        assert torch.equal(torch.isfinite(log_probs).sum(-1), torch.ones(2, 16, dtype=torch.long))


@pytest.mark.parametrize("temperature,top_k,top_p", SAMPLER_SETTINGS)
def test_sampler_matches_transformers_warpers(temperature, top_k, top_p):
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    generator = torch.Generator().manual_seed(99)
    logits = 2.5 * torch.randn(32, 11, generator=generator)
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k is not None:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    torch.testing.assert_close(
        Sampler(temperature, top_k, top_p).log_probs(logits).exp(), scores.softmax(-1), rtol=1e-5, atol=1e-6
    )
    warped = logits.clone()  # what generate draws from: Sampler.warpers(), in order, the same scores
    for warper in Sampler(temperature, top_k, top_p).warpers():
        warped = warper(None, warped)
    assert torch.equal(warped, scores)


def test_sampler_log_probs_gradient_is_score_of_truncated_distribution():
    # d/dz log mu(a) = (1/tau) (onehot(a) - mu) on the kept set, 0 on truncated tokens.
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0], requires_grad=True)
    sampler = Sampler(0.8, 3, 1.0)
    log_mu = sampler.log_probs(logits)
    (grad,) = torch.autograd.grad(log_mu[1], logits)
    mu = torch.tensor(py_sampler_probs(logits.tolist(), 0.8, 3, 1.0))
    expected = (torch.nn.functional.one_hot(torch.tensor(1), 5).float() - mu.float()) / 0.8
    torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6)


def test_packed_support_round_trips_and_scores_like_the_recomputed_one():
    """pack_support keeps bit j of byte i = mask[8 i + j]; scoring on a given support equals the
    truncation recomputed from the same logits (V = 13: not a multiple of 8)."""
    logits = 2.5 * torch.randn(5, 13, generator=torch.Generator().manual_seed(7))
    sampler = Sampler(0.9, 6, 0.8)
    recomputed = sampler.log_probs(logits)
    mask = recomputed > float("-inf")
    packed = pack_support(mask)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 2)
    for row in range(5):
        assert [int(b) for b in packed[row]] == [
            sum(1 << j for j in range(8) if 8 * i + j < 13 and mask[row, 8 * i + j]) for i in range(2)
        ]
    assert torch.equal(unpack_support(packed, 13), mask)
    torch.testing.assert_close(sampler.log_probs(logits, mask), recomputed)
