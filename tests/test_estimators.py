"""The token estimator, the engines and the prompt schedule, against plain references."""

import itertools

import pytest
import torch
from test_estimate_fisher import PROMPTS, T, enum_model, flat, mass_ratio, pearson
from support.tiny import tiny_llama

from hf_cfp import estimate_fisher
from hf_cfp.fisher.sampling import Sampler, batch_generator, sample_responses


def _scores(model, prompt, response):
    """Per-position token scores xi_t = d/dtheta log pi(y_t | x, y_<t), one plain forward each."""
    params = list(model.parameters())
    xis = []
    for t, token in enumerate(response):
        logits = model(input_ids=torch.tensor([prompt + response[:t]])).logits[0, -1].double()
        xis.append([g.double() for g in torch.autograd.grad(logits.log_softmax(0)[token], params)])
    return xis


def test_sequence_and_token_fisher_have_the_same_expectation_by_exact_enumeration():
    """E[(sum_t xi_t)^2] = E[sum_t xi_t^2] over every response: cross terms vanish on-policy,
    although they do not vanish response by response."""
    model = enum_model()
    vocab = model.config.vocab_size
    sequence = [torch.zeros_like(p, dtype=torch.float64) for p in model.parameters()]
    token = [torch.zeros_like(s) for s in sequence]
    largest_pointwise_gap = 0.0
    for prompt in PROMPTS:
        for response in itertools.product(range(vocab), repeat=T):
            response = list(response)
            xis = _scores(model, prompt, response)
            with torch.no_grad():
                ids = torch.tensor([prompt + response])
                logp = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].double().log_softmax(-1)
                prob = float(logp[torch.arange(T), torch.tensor(response)].sum().exp()) / len(PROMPTS)
            for i in range(len(sequence)):
                h = sum(x[i] for x in xis)
                sequence[i] += prob * h**2
                token[i] += prob * sum(x[i] ** 2 for x in xis)
                largest_pointwise_gap = max(largest_pointwise_gap, float((h**2 - sum(x[i] ** 2 for x in xis)).abs().max()))
    seq, tok = torch.cat([s.flatten() for s in sequence]), torch.cat([t.flatten() for t in token])
    torch.testing.assert_close(tok, seq, rtol=1e-6, atol=1e-9 * float(seq.max()))
    assert largest_pointwise_gap > 1e-2 * float(seq.max())  # the identity holds only in expectation


def test_token_estimator_matches_the_exact_fisher(tmp_path):
    from test_estimate_fisher import exact_fisher

    model = enum_model()
    exact = flat(exact_fisher(model, PROMPTS), model)
    anchor = estimate_fisher(model, None, PROMPTS, num_sequences=2000, max_new_tokens=T, batch_size=64, seed=0,
                             estimator="token", show_progress=False)
    ratio, corr = mass_ratio(flat(anchor, model), exact), pearson(flat(anchor, model), exact)
    print(f"token estimator: mass ratio {ratio:.4f}, Pearson {corr:.4f}")
    assert abs(ratio - 1) < 0.05 and corr >= 0.95
    assert anchor.metadata["estimator"] == "token"


def test_token_estimator_equals_a_per_token_loop_on_the_same_draws():
    model = tiny_llama(vocab_size=16, seed=2)
    prompts, n, batch = [[1, 2, 3], [4, 5]], 6, 3
    anchor = estimate_fisher(model, None, prompts, num_sequences=n, max_new_tokens=4, batch_size=batch, seed=5,
                             estimator="token", show_progress=False)
    reference = [torch.zeros_like(p, dtype=torch.float64) for p in model.parameters()]
    for k in range(n // batch):
        batch_prompts = [prompts[i % 2] for i in range(k * batch, (k + 1) * batch)]
        for prompt, response in zip(batch_prompts, sample_responses(
                model.eval(), batch_prompts, Sampler(), 4, set(), 0, batch_generator(5, k))):
            for xi in _scores(model, prompt, response):
                for r, x in zip(reference, xi):
                    r += x**2 / n
    for (name, _), ref in zip(model.named_parameters(), reference):
        torch.testing.assert_close(anchor.fisher[name].double(), ref, rtol=1e-5, atol=1e-8 * float(ref.max()))


@pytest.mark.parametrize("estimator", ["sequence", "token"])
def test_batched_and_loop_engines_give_the_same_anchor(estimator):
    model = tiny_llama(vocab_size=24, seed=3, eos_token_id=5)
    options = dict(num_sequences=12, max_new_tokens=6, batch_size=4, seed=1, estimator=estimator, show_progress=False)
    batched = estimate_fisher(model, None, [[1, 2, 3, 4], [6], [7, 8]], engine="batched", **options)
    loop = estimate_fisher(model, None, [[1, 2, 3, 4], [6], [7, 8]], engine="loop", **options)
    for name, tensor in loop.fisher.items():
        torch.testing.assert_close(batched.fisher[name], tensor, rtol=1e-5, atol=1e-6 * float(tensor.max()))
    assert batched.metadata["mean_response_tokens"] == loop.metadata["mean_response_tokens"]


def test_num_samples_per_prompt_draws_consecutive_samples_of_each_prompt():
    model = tiny_llama(vocab_size=16, seed=4)
    options = dict(num_sequences=8, max_new_tokens=3, batch_size=4, seed=9, show_progress=False)
    repeated = estimate_fisher(model, None, [[1, 2], [3]], num_samples_per_prompt=2, **options)
    spelled_out = estimate_fisher(model, None, [[1, 2], [1, 2], [3], [3]], **options)
    assert all(torch.equal(repeated.fisher[n], spelled_out.fisher[n]) for n in repeated.fisher)
    assert repeated.metadata["num_samples_per_prompt"] == 2
