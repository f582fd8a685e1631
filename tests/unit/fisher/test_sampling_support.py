"""Top-k / top-p: each token is scored on the support of mu it was drawn from, never on a support
recomputed at scoring time that may have lost it (log mu = -inf and a finite, wrong score).

The scoring forward (right-padded, no KV cache) differs from the sampling one (KV cache) in the last
bits, enough on a GPU in bf16 to move a token across the k-th or nucleus boundary. `shift_when_sampling`
forces that deterministically: the KV-cache forward sees logits + DELTA, so many drawn tokens lie
outside the support of the scoring logits. The reference, written here with transformers' own
warpers for the support, is the score of the distribution that drew y: the scoring logits
renormalized over the sampling-time support S, S held fixed.
"""

import functools
import logging

import pytest
import torch
from support.tiny import tiny_llama
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from hf_cfp import estimate_fisher
from hf_cfp.errors import CFPArgumentError
from hf_cfp.fisher.batched import add_batched_squared_scores
from hf_cfp.fisher.sampling import Sampler, batch_generator, sample_responses
from hf_cfp.fisher.scoring import sequence_log_prob

VOCAB, NEW, N, BATCH, SEED = 16, 5, 8, 4, 3
PROMPTS = [[1, 2, 3], [4], [5, 6]]
DELTA = torch.zeros(VOCAB).index_fill_(0, torch.tensor([7, 8, 9, 10]), 1.0)  # what the sampling forward adds


def shift_when_sampling(model):
    """The model with DELTA added to its logits in the KV-cache forward (use_cache=True: sampling)."""
    forward = model.forward

    @functools.wraps(forward)
    def shifted(*args, **kwargs):
        out = forward(*args, **kwargs)
        if kwargs.get("use_cache"):
            out.logits = out.logits + DELTA
        return out

    model.forward = shifted
    return model


def model_with_spread_logits():
    model = tiny_llama(vocab_size=VOCAB, seed=5).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(10)  # logits of order 1, so that DELTA reorders some but not all
    return shift_when_sampling(model)


def support_of(scores, top_k, top_p):
    """The tokens mu keeps, by transformers' warpers (temperature 1)."""
    if top_k is not None:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores > float("-inf")


def drawn_pairs(model, sampler):
    """The (prompt, response) pairs estimate_fisher draws: batch k from the stream batch_generator(SEED, k)."""
    pairs = []
    for k in range(N // BATCH):
        batch = [PROMPTS[n % len(PROMPTS)] for n in range(k * BATCH, (k + 1) * BATCH)]
        drawn = sample_responses(model, batch, sampler, NEW, set(), 0, batch_generator(SEED, k))
        pairs += zip(batch, drawn, strict=True)
    return pairs


def reference_fisher(model, pairs, top_k, top_p, estimator="sequence"):
    """F = (1/N) sum_n (d log mu_S(y_n | x_n))^2 ("sequence") or (1/N) sum_n sum_t (d log mu_S(y_n,t | .))^2
    ("token"), S the sampling-time support (of logits + DELTA), plain autograd per sequence; also the
    number of drawn tokens outside the scoring logits' own support."""
    names, params = zip(*model.named_parameters(), strict=True)
    sums = [torch.zeros_like(p) for p in params]
    outside = 0
    for prompt, response in pairs:
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
        drawn_from = support_of(logits.detach() + DELTA, top_k, top_p)
        targets = torch.tensor(response)
        outside += int((~support_of(logits.detach(), top_k, top_p)[torch.arange(len(response)), targets]).sum())
        log_mu = logits.masked_fill(~drawn_from, float("-inf")).log_softmax(-1)[torch.arange(len(response)), targets]
        scored = [log_mu.sum()] if estimator == "sequence" else list(log_mu)
        for log_prob in scored:
            for s, g in zip(sums, torch.autograd.grad(log_prob, params, retain_graph=True), strict=True):
                s += g**2
    return {name: s / len(pairs) for name, s in zip(names, sums, strict=True)}, outside


@pytest.mark.parametrize("top_k,top_p,estimator", [(4, 1.0, "sequence"), (None, 0.5, "sequence"), (4, 0.7, "token")])
def test_tokens_are_scored_on_the_support_they_were_drawn_from(top_k, top_p, estimator, caplog):
    model = model_with_spread_logits()
    pairs = drawn_pairs(model, Sampler(1.0, top_k, top_p))
    want, outside = reference_fisher(model, pairs, top_k, top_p, estimator)
    assert outside >= 3, f"only {outside} drawn tokens outside the scoring-time support: nothing is tested"
    options = dict(num_sequences=N, max_new_tokens=NEW, batch_size=BATCH, seed=SEED, estimator=estimator)
    with caplog.at_level(logging.INFO, logger="hf_cfp.fisher.batched"):
        for engine in ("batched", "loop"):
            anchor = estimate_fisher(
                model, None, PROMPTS, top_k=top_k, top_p=top_p, engine=engine, show_progress=False, **options
            )
            for name, tensor in want.items():
                assert tensor.abs().max() > 0, name
                torch.testing.assert_close(
                    anchor.fisher[name], tensor, rtol=1e-5, atol=1e-6 * float(tensor.max()), msg=f"{engine} {name}"
                )
    assert not [r for r in caplog.records if r.name == "hf_cfp.fisher.batched"]  # no fallback to the loop
    print(f"\ntop_k={top_k} top_p={top_p}: {outside} of {N * NEW} drawn tokens outside the scoring-time support")


def test_a_token_outside_the_recomputed_support_raises_naming_sequence_and_position():
    """Scored without the sampling-time supports, a response token that the scoring logits truncate
    raises in both engines instead of scoring log mu = -inf."""
    model = model_with_spread_logits()
    sampler = Sampler(top_k=4)
    prompts = [[4], [4]]
    with torch.no_grad():  # the most likely token, then (sequence 1) the scoring logits' least likely one
        first = int(model(input_ids=torch.tensor([[4]])).logits[0, -1].argmax())
        last = int(model(input_ids=torch.tensor([[4, first]])).logits[0, -1].argmin())
    responses = [[first], [first, last]]
    sums = [torch.zeros_like(p) for p in model.parameters()]
    with pytest.raises(CFPArgumentError, match=rf"Sequence 1 of the batch, response position 1 \(token {last}\)"):
        add_batched_squared_scores(model, list(model.parameters()), sums, prompts, responses, sampler)
    assert all(float(s.abs().sum()) == 0 for s in sums)  # nothing was added
    with pytest.raises(CFPArgumentError, match=rf"response position 1 \(token {last}\).*supports="):
        sequence_log_prob(model, prompts[1], responses[1], sampler)
