"""Sampling through `model.generate` (hf_cfp/fisher/generation.py): the tokens come from the sampler's mu and
nothing else, the recorded supports are mu's, the model's own generation config cannot leak in, and the random
state is the batch's own.

The reference for mu is plain Python on the logits of a plain forward (`py_sampler_probs`); the frequencies of
N draws of the first token must lie within 4.5 binomial standard deviations sqrt(mu (1 - mu) / N) of mu (a
false alarm about once in 10^5 per token), while a leaked warper (top_k=2, temperature 0.3, a repetition
penalty) moves them by tens of standard deviations.
"""

import pytest
import torch
from support.enumeration import enum_model
from support.references import py_sampler_probs
from support.tiny import tiny_llama

from hf_cfp.errors import CFPArgumentError
from hf_cfp.fisher.generation import UNSETTABLE_GENERATION_SETTINGS, until_eos
from hf_cfp.fisher.sampling import Sampler, batch_generator, sample_responses, sample_with_supports, unpack_support

PROMPT = [1, 4, 2]
DRAWS = 4000
SAMPLERS = [Sampler(), Sampler(0.6), Sampler(1.0, 3), Sampler(1.0, None, 0.7), Sampler(1.4, 4, 0.8)]


def leaky(model):
    """`model` with a generation config that would change every draw if generate used it."""
    config = model.generation_config
    config.do_sample, config.num_beams, config.top_k, config.top_p, config.temperature = False, 3, 2, 0.5, 0.3
    config.repetition_penalty, config.no_repeat_ngram_size, config.min_new_tokens = 3.0, 1, 2
    config.eos_token_id, config.max_length = 1, 2
    return model


def first_token_mu(model, sampler):
    with torch.no_grad():
        row = model(input_ids=torch.tensor([PROMPT])).logits[0, -1].double().tolist()
    return torch.tensor(py_sampler_probs(row, sampler.temperature, sampler.top_k, sampler.top_p), dtype=torch.float64)


@pytest.mark.parametrize("sampler", SAMPLERS, ids=lambda s: f"T{s.temperature}-k{s.top_k}-p{s.top_p}")
def test_first_tokens_are_drawn_from_mu_and_nothing_else(sampler):
    model = leaky(enum_model().eval())
    drawn = sample_responses(model, [PROMPT] * DRAWS, sampler, 1, set(), 0, batch_generator(0, 0))
    counts = torch.bincount(torch.tensor([r[0] for r in drawn]), minlength=6).double()
    mu = first_token_mu(model, sampler)
    sigma = (mu * (1 - mu) / DRAWS).sqrt()
    deviation = ((counts / DRAWS - mu).abs() / sigma.clamp_min(1e-12))[mu > 0]
    print(f"{sampler}: mu {mu.numpy().round(3)}, counts {counts.numpy()}, largest deviation {deviation.max():.2f} sd")
    assert torch.equal(counts > 0, mu > 0)  # never a token outside mu's support; every token of it at N = 4000
    assert float(deviation.max()) < 4.5


@pytest.mark.parametrize("sampler", [Sampler(1.0, 3), Sampler(0.8, None, 0.6), Sampler(1.2, 4, 0.9)])
def test_the_recorded_supports_are_mu_s_at_every_step(sampler):
    """Each response token's recorded support is the support of mu on the logits of a plain forward of its prefix,
    and holds the token (eos 0: responses of different lengths)."""
    model = leaky(enum_model().eval())
    prompts = [PROMPT, [5, 0], [3]] * 8
    responses, supports = sample_with_supports(model, prompts, sampler, 4, {0}, 5, batch_generator(1, 2))
    assert len({len(r) for r in responses}) > 1
    for prompt, response, packed in zip(prompts, responses, supports, strict=True):
        assert packed.dtype == torch.uint8 and packed.shape == (len(response), 1) and packed.device.type == "cpu"
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
        for t, token in enumerate(response):
            mu = py_sampler_probs(logits[t].double().tolist(), sampler.temperature, sampler.top_k, sampler.top_p)
            recorded = unpack_support(packed[t], 6)
            assert recorded.tolist() == [p > 0 for p in mu] and bool(recorded[token])


def test_an_untruncated_sampler_records_no_support():
    model = tiny_llama(vocab_size=12)
    responses, supports = sample_with_supports(model, [[1, 2], [3]], Sampler(0.7), 3, set(), 0, batch_generator(0, 0))
    assert supports == [None, None] and [len(r) for r in responses] == [3, 3]


def test_the_model_generation_config_does_not_change_the_draws():
    prompts = [[1, 2, 3], [4, 5], [6]]
    clean = tiny_llama(vocab_size=16, seed=4).eval()
    for sampler in (Sampler(), Sampler(0.5, 5, 0.9)):
        want = sample_with_supports(clean, prompts, sampler, 6, {0}, 0, batch_generator(2, 0))
        leaked = leaky(tiny_llama(vocab_size=16, seed=4).eval())
        got = sample_with_supports(leaked, prompts, sampler, 6, {0}, 0, batch_generator(2, 0))
        assert got[0] == want[0]
        assert all(a is b is None or torch.equal(a, b) for a, b in zip(got[1], want[1], strict=True))


@pytest.mark.parametrize("setting,value", [("suppress_tokens", [3]), ("min_p", 0.2), ("forced_eos_token_id", 1)])
def test_a_setting_only_none_turns_off_is_refused_by_name(setting, value):
    assert setting in UNSETTABLE_GENERATION_SETTINGS
    model = tiny_llama(vocab_size=12)
    setattr(model.generation_config, setting, value)
    with pytest.raises(CFPArgumentError, match=rf"model.generation_config sets \{{'{setting}'"):
        sample_responses(model, [[1, 2]], Sampler(), 3, set(), 0, batch_generator(0, 0))


def test_each_batch_draws_from_its_own_stream_and_the_callers_state_is_kept():
    """The draws depend on (seed, k) alone: not on the global random state, nor on the batches drawn before;
    the global random state comes back as it was; another k or seed draws other tokens."""
    model = tiny_llama(vocab_size=32, seed=1).eval()
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]

    def draw(seed, k):
        return sample_responses(model, prompts, Sampler(), 8, set(), 0, batch_generator(seed, k))

    torch.manual_seed(123)
    first = [draw(0, 0), draw(0, 1)]
    after = torch.rand(4)
    torch.manual_seed(123)
    assert torch.equal(torch.rand(4), after)  # the caller's random state was left where it was
    torch.manual_seed(7)
    assert [draw(0, 1), draw(0, 0)] == first[::-1]  # any order, any global state: the same tokens
    assert first[0] != first[1] and draw(1, 0) != first[0]
    generator = batch_generator(0, 0)
    assert sample_responses(model, prompts, Sampler(), 8, set(), 0, generator) == first[0]
    assert sample_responses(model, prompts, Sampler(), 8, set(), 0, generator) != first[0]  # the stream moved on


def test_responses_end_at_their_first_eos_and_no_padding_comes_back():
    model = tiny_llama(vocab_size=8, seed=2).eval()  # EOS 0 and 1 about 1 token in 4: most responses end early
    prompts = [[2, 3], [4], [5, 6, 7]] * 6
    responses = sample_responses(model, prompts, Sampler(), 10, {0, 1}, 7, batch_generator(0, 3))
    ended = [r for r in responses if r[-1] in (0, 1)]
    assert 0 < len(ended) < len(responses)
    for response in responses:
        assert 1 <= len(response) <= 10
        assert not {0, 1} & set(response[:-1])  # nothing after the first EOS
        assert response[-1] in (0, 1) or len(response) == 10
    assert until_eos([3, 1, 0, 1], {0, 1}) == [3, 1] and until_eos([3, 4], {0}) == [3, 4]
