"""estimate_fisher against independent references.

The references here never call hf_cfp's scoring code: exact Fishers come from enumerating every
response of a tiny model (a prefix tree of plain forwards, the sampler distribution written out
by hand, per-response scores from torch.autograd.grad), the sampler is checked against plain
Python and against transformers' own logits warpers, and the empirical / EOS cases are checked
against plain loops.

Monte Carlo tolerances (5% on the total mass, Pearson >= 0.95 across coordinates) were sized from
the exact per-sequence variance of the model below: with N_MC = 2000 the relative standard
deviation of the total mass is about 1.3-1.6%, so 5% is more than 3 sigma, while every "must differ"
assertion is a gap of 25% or more.
"""

import hashlib
import itertools
import json
import math

import pytest
import torch
from support.tiny import tiny_llama, tiny_tokenizer

from hf_cfp import CFPArgumentError, estimate_fisher
from hf_cfp.fisher import Sampler
from hf_cfp.fisher.sampling import batch_generator, sample_responses

V = 6  # vocabulary of the enumeration model
T = 3  # response length (fixed when there is no EOS)
PROMPTS = [[1, 4, 2], [5, 0]]  # different lengths: sampling left-pads them in one batch
N_MC = 2000
MC_BATCH = 64
MASS_TOL = 0.05
MIN_CORR = 0.95


def enum_model(**overrides):
    # initializer_range 0.3: clearly non-uniform next-token distributions (0.10-0.27 on the first
    # prompt) with the lightest per-sequence score tails among the tiny configurations measured.
    return tiny_llama(vocab_size=V, hidden_size=8, layers=1, initializer_range=0.3, **overrides)


# ----------------------------------------------------------------------------------------------
# Independent references
# ----------------------------------------------------------------------------------------------


def ref_log_mu(logits_row, temperature=1.0, top_k=None):
    """log of the sampler's next-token distribution, written out: z / tau, keep the k largest
    (ranked in Python, the mask carries no gradient), renormalize. Float64."""
    z = logits_row.double() / temperature
    if top_k is not None:
        values = z.detach().tolist()
        ranked = sorted(range(len(values)), key=lambda a: values[a], reverse=True)
        keep = torch.zeros(len(values), dtype=torch.bool)
        keep[ranked[:top_k]] = True
        z = z.masked_fill(~keep, float("-inf"))
    return z - torch.logsumexp(z, dim=0)


def all_responses(vocab, length, eos=()):
    """Every complete response: it ends at its first EOS or after `length` tokens."""
    out = []

    def grow(prefix):
        if len(prefix) == length or (prefix and prefix[-1] in eos):
            out.append(tuple(prefix))
            return
        for a in range(vocab):
            grow(prefix + [a])

    grow([])
    return out


def exact_fisher(model, prompts, temperature=1.0, top_k=None, eos=(), length=T):
    """F = mean_x sum_y mu(y|x) g(y)^2, g = d/dtheta log mu(y|x), by enumerating every response.

    log mu(y|x) = sum_t log mu(y_t | x, y_<t), each conditional from its own forward of the
    prefix x + y_<t (no teacher forcing, no cache). Returns {name: float64 tensor}, and checks
    that mu sums to 1 and that the score is centered (sum_y mu g = 0) for every prompt.
    """
    named = list(model.named_parameters())
    params = [p for _, p in named]
    fisher = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    vocab = model.config.vocab_size
    for prompt in prompts:
        nodes = {}

        def log_mu(prefix):
            if prefix not in nodes:
                logits = model(input_ids=torch.tensor([prompt + list(prefix)])).logits[0, -1]
                nodes[prefix] = ref_log_mu(logits, temperature, top_k)
            return nodes[prefix]

        total_prob = 0.0
        mean_score = [torch.zeros_like(f) for f in fisher]
        for y in all_responses(vocab, length, eos):
            log_prob = sum(log_mu(y[:t])[y[t]] for t in range(len(y)))
            prob = math.exp(float(log_prob.detach()))
            total_prob += prob
            if prob == 0.0:  # contains a truncated token: never drawn
                continue
            grads = torch.autograd.grad(log_prob, params, retain_graph=True, allow_unused=True)
            for f, m, g in zip(fisher, mean_score, grads):
                if g is not None:
                    f.add_(prob * g.double() ** 2 / len(prompts))
                    m.add_(prob * g.double())
        assert total_prob == pytest.approx(1.0, abs=1e-9)
        flat_mean = torch.cat([m.flatten() for m in mean_score])
        assert float(flat_mean.abs().max()) < 1e-5 * max(1.0, float(torch.cat([f.flatten() for f in fisher]).max()))
    return {name: f for (name, _), f in zip(named, fisher)}


def ref_sequence_score(model, prompt, response):
    """(d/dtheta log pi(response | prompt)) for temperature 1, one plain forward, float64 log-softmax."""
    params = [p for _, p in model.named_parameters()]
    ids = torch.tensor([prompt + response])
    logits = model(input_ids=ids).logits[0].double()
    log_prob = sum(logits[len(prompt) - 1 + t].log_softmax(0)[tok] for t, tok in enumerate(response))
    return [g.double() for g in torch.autograd.grad(log_prob, params)]


def ref_mean_squared_score(model, pairs):
    names = [n for n, _ in model.named_parameters()]
    sums = None
    for prompt, response in pairs:
        g = ref_sequence_score(model, prompt, response)
        sums = [x ** 2 for x in g] if sums is None else [s + x ** 2 for s, x in zip(sums, g)]
    return {n: s / len(pairs) for n, s in zip(names, sums)}


def flat(fisher, model):
    """Concatenate in the model's parameter order (accepts a FisherAnchor or a dict)."""
    tensors = getattr(fisher, "fisher", fisher)
    return torch.cat([tensors[n].double().flatten() for n, _ in model.named_parameters()])


def mass_ratio(estimate, reference):
    return float(estimate.sum() / reference.sum())


def pearson(a, b):
    return float(torch.corrcoef(torch.stack([a, b]))[0, 1])


def mc_estimate(model, **kwargs):
    anchor = estimate_fisher(model, None, PROMPTS, num_sequences=N_MC, max_new_tokens=T, batch_size=MC_BATCH,
                             seed=0, show_progress=False, **kwargs)
    return anchor, flat(anchor, model)


def assert_matches(estimate, exact, what):
    ratio, corr = mass_ratio(estimate, exact), pearson(estimate, exact)
    print(f"{what}: mass ratio {ratio:.4f}, Pearson {corr:.4f}")
    assert abs(ratio - 1) < MASS_TOL, f"{what}: total mass ratio {ratio:.4f} (estimate / exact)"
    assert corr >= MIN_CORR, f"{what}: Pearson correlation {corr:.4f}"
    return ratio, corr


@pytest.fixture(scope="module")
def model():
    return enum_model()


@pytest.fixture(scope="module")
def exact_t1(model):
    return flat(exact_fisher(model, PROMPTS), model)


# ----------------------------------------------------------------------------------------------
# 1-3. On-policy estimate vs exact enumeration
# ----------------------------------------------------------------------------------------------


def test_reference_model_is_not_uniform(model):
    with torch.no_grad():
        for prompt in PROMPTS:
            probs = model(input_ids=torch.tensor([prompt])).logits[0, -1].softmax(-1)
            assert float(probs.max() / probs.min()) > 2.0


def test_sequence_fisher_matches_exact_enumeration_temperature_1(model, exact_t1):
    anchor, estimate = mc_estimate(model)
    assert_matches(estimate, exact_t1, "temperature 1")
    assert anchor.metadata["mean_response_tokens"] == T  # no EOS: every response has T tokens
    assert set(anchor.fisher) == {n for n, _ in model.named_parameters()}


def test_sequence_fisher_matches_tempered_exact_fisher(model, exact_t1):
    exact_tempered = flat(exact_fisher(model, PROMPTS, temperature=0.7), model)
    _, estimate = mc_estimate(model, temperature=0.7)
    assert_matches(estimate, exact_tempered, "temperature 0.7")
    # The test discriminates: the tempered Fisher is a different quantity from the T=1 Fisher, far
    # beyond the tolerance (scoring with log pi instead of log mu, or sampling at T=1, would fail).
    exact_gap = mass_ratio(exact_tempered, exact_t1)
    estimate_gap = mass_ratio(estimate, exact_t1)
    print(f"tempered/T=1 exact mass {exact_gap:.3f}, estimate/T=1 exact mass {estimate_gap:.3f}")
    assert exact_gap > 1.25
    assert abs(estimate_gap - 1) > 5 * MASS_TOL


def test_sequence_fisher_matches_top_k_exact_fisher(model, exact_t1):
    exact_top_k = flat(exact_fisher(model, PROMPTS, top_k=3), model)
    anchor, estimate = mc_estimate(model, top_k=3)
    assert_matches(estimate, exact_top_k, "top_k=3")
    assert anchor.metadata["sampler"] == {"temperature": 1.0, "top_k": 3, "top_p": 1.0, "max_new_tokens": T}
    exact_gap = mass_ratio(exact_top_k, exact_t1)
    estimate_gap = mass_ratio(estimate, exact_t1)
    print(f"top-k/full exact mass {exact_gap:.3f}, estimate/full exact mass {estimate_gap:.3f}")
    assert abs(exact_gap - 1) > 0.25
    assert abs(estimate_gap - 1) > 5 * MASS_TOL


def test_sequence_fisher_stops_at_eos_matches_exact_enumeration():
    eos = 3
    model = enum_model(eos_token_id=eos)
    exact = flat(exact_fisher(model, PROMPTS, eos={eos}), model)
    anchor, estimate = mc_estimate(model)  # eos from the model's generation config
    assert_matches(estimate, exact, "with EOS")
    # Scoring the tokens a fixed-length sampler would draw after EOS gives another Fisher.
    exact_no_stop = flat(exact_fisher(model, PROMPTS), model)
    gap = mass_ratio(exact_no_stop, exact)
    print(f"fixed-length/EOS-terminated exact mass {gap:.3f}, mean tokens {anchor.metadata['mean_response_tokens']}")
    assert abs(gap - 1) > 0.25
    assert 1 < anchor.metadata["mean_response_tokens"] < T


# ----------------------------------------------------------------------------------------------
# 4. Empirical Fisher
# ----------------------------------------------------------------------------------------------


def test_empirical_fisher_is_mean_squared_label_score_and_differs_from_on_policy(model, exact_t1):
    # Per prompt, the least and the most likely length-T response under the model.
    rare, modal = [], []
    with torch.no_grad():
        for prompt in PROMPTS:
            def log_pi(y):
                logits = model(input_ids=torch.tensor([prompt + list(y)])).logits[0].double()
                return sum(float(logits[len(prompt) - 1 + t].log_softmax(0)[y[t]]) for t in range(T))
            scored = sorted(all_responses(V, T), key=log_pi)
            rare.append(list(scored[0]))
            modal.append(list(scored[-1]))

    for labels, direction in ((rare, "rare"), (modal, "modal")):
        anchor = estimate_fisher(model, None, PROMPTS, num_sequences=4, max_new_tokens=T, estimator="empirical",
                                 responses=labels, show_progress=False)
        reference = ref_mean_squared_score(model, list(zip(PROMPTS, labels)))
        scale = max(float(t.max()) for t in reference.values())
        for name, ref in reference.items():
            torch.testing.assert_close(anchor.fisher[name].double(), ref, rtol=1e-5, atol=1e-7 * scale)
        assert anchor.metadata["estimator"] == "empirical" and anchor.metadata["sampler"] is None
        assert anchor.metadata["mean_response_tokens"] == T

        estimate = flat(anchor, model)
        ratio, corr = mass_ratio(estimate, exact_t1), pearson(estimate, exact_t1)
        print(f"empirical ({direction} labels) / on-policy exact: mass ratio {ratio:.3f}, Pearson {corr:.3f}")
        if direction == "rare":
            assert ratio > 1.5  # unlikely labels: large scores, far more mass than the on-policy Fisher
        # Even the model's own most likely responses give another shape: the on-policy estimates
        # above correlate >= 0.99 with the exact Fisher, two labels per prompt do not come close.
        assert corr < 0.85


# ----------------------------------------------------------------------------------------------
# 5. Sampler
# ----------------------------------------------------------------------------------------------


def py_sampler_probs(row, temperature, top_k, top_p):
    """Plain Python: z/tau; keep the top_k largest; softmax; keep the smallest top set whose
    cumulative probability reaches top_p; renormalize."""
    z = [v / temperature for v in row]
    order = sorted(range(len(z)), key=lambda a: z[a], reverse=True)
    if top_k is not None:
        order = order[:top_k]
    peak = max(z[a] for a in order)
    weights = {a: math.exp(z[a] - peak) for a in order}
    total = sum(weights.values())
    probs = {a: w / total for a, w in weights.items()}
    kept, cumulative = [], 0.0
    for a in order:
        kept.append(a)
        cumulative += probs[a]
        if cumulative >= top_p:
            break
    mass = sum(probs[a] for a in kept)
    return [probs[a] / mass if a in kept else 0.0 for a in range(len(z))]


SAMPLER_SETTINGS = [
    (1.0, None, 1.0), (0.7, None, 1.0), (1.5, None, 1.0), (1.0, 3, 1.0), (1.0, 1, 1.0),
    (1.0, None, 0.3), (1.0, None, 0.9), (0.5, None, 0.6), (1.3, 5, 0.6), (0.8, 2, 0.95), (1.0, None, 1e-6),
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
    torch.testing.assert_close(Sampler(temperature, top_k, top_p).log_probs(logits).exp(), scores.softmax(-1),
                               rtol=1e-5, atol=1e-6)


def test_sampler_log_probs_gradient_is_score_of_truncated_distribution():
    # d/dz log mu(a) = (1/tau) (onehot(a) - mu) on the kept set, 0 on truncated tokens.
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0], requires_grad=True)
    sampler = Sampler(0.8, 3, 1.0)
    log_mu = sampler.log_probs(logits)
    (grad,) = torch.autograd.grad(log_mu[1], logits)
    mu = torch.tensor(py_sampler_probs(logits.tolist(), 0.8, 3, 1.0))
    expected = (torch.nn.functional.one_hot(torch.tensor(1), 5).float() - mu.float()) / 0.8
    torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# 6. Reproducibility and hygiene
# ----------------------------------------------------------------------------------------------


def _estimate(model, **kwargs):
    options = dict(num_sequences=24, max_new_tokens=T, batch_size=8, seed=0, show_progress=False)
    options.update(kwargs)
    return estimate_fisher(model, None, PROMPTS, **options)


def test_same_seed_is_bit_identical_and_another_seed_differs():
    model = enum_model(seed=1)
    first, second, other = _estimate(model), _estimate(model), _estimate(model, seed=1)
    assert first.fisher.keys() == second.fisher.keys() == other.fisher.keys()
    assert all(torch.equal(first.fisher[n], second.fisher[n]) for n in first.fisher)
    assert not all(torch.equal(first.fisher[n], other.fisher[n]) for n in first.fisher)
    assert first.metadata["prompts_sha256"] == other.metadata["prompts_sha256"]
    assert (first.metadata["seed"], other.metadata["seed"]) == (0, 1)


@pytest.mark.parametrize("training", [True, False])
def test_model_mode_weights_and_grads_are_left_alone(training):
    model = enum_model(seed=2)
    model.train(training)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    anchor = _estimate(model)
    assert model.training is training
    assert all(m.training is training for m in model.modules())
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all(p.requires_grad for p in model.parameters())
    for name, param in model.named_parameters():
        assert anchor.fisher[name].shape == param.shape and anchor.fisher[name].dtype == torch.float32


def test_trainable_only_skips_frozen_parameters_and_restores_requires_grad():
    model = enum_model(seed=3)
    frozen_name = "model.embed_tokens.weight"
    frozen = dict(model.named_parameters())[frozen_name]
    frozen.requires_grad_(False)

    default = _estimate(model)
    assert frozen_name not in default.fisher
    assert set(default.fisher) == {n for n, p in model.named_parameters() if p.requires_grad}
    assert default.metadata["trainable_only"] is True

    everything = _estimate(model, trainable_only=False)
    assert frozen_name in everything.fisher
    assert float(everything.fisher[frozen_name].sum()) > 0
    assert frozen.requires_grad is False
    assert all(p.requires_grad for n, p in model.named_parameters() if n != frozen_name)
    assert all(p.grad is None for p in model.parameters())
    assert everything.metadata["trainable_only"] is False
    for name, tensor in default.fisher.items():  # same samples: the other coordinates are unchanged
        torch.testing.assert_close(everything.fisher[name], tensor, rtol=1e-6, atol=0)
    # ...and the frozen coordinates are the plain-loop reference on the same draws.
    frozen.requires_grad_(True)  # the reference differentiates every parameter
    try:
        reference = _reference_on_same_draws(model, Sampler(), seed=0, num_sequences=24, batch_size=8,
                                             eos_ids=set(), pad_id=0)
    finally:
        frozen.requires_grad_(False)
    torch.testing.assert_close(everything.fisher[frozen_name].double(), reference[frozen_name], rtol=1e-5,
                               atol=1e-7 * float(reference[frozen_name].max()))


# ----------------------------------------------------------------------------------------------
# 7. Prompt forms and metadata
# ----------------------------------------------------------------------------------------------


def test_prompt_forms_give_the_same_anchor_and_metadata_is_consistent():
    from datasets import Dataset

    tokenizer = tiny_tokenizer()
    assert len(tokenizer) <= 320
    model = tiny_llama(vocab_size=320, hidden_size=8, layers=1, initializer_range=0.3)
    texts = ["what is two plus three", "print the sum"]
    # The chat template written out by hand (tests/tiny.py), tokenized without extra specials.
    token_ids = [tokenizer(f"<|user|>{t}<|end|><|assistant|>", add_special_tokens=False)["input_ids"] for t in texts]
    assert token_ids[0][0] == tokenizer.convert_tokens_to_ids("<|user|>")
    assert token_ids[0][-1] == tokenizer.convert_tokens_to_ids("<|assistant|>")
    forms = {
        "strings": texts,
        "messages": [[{"role": "user", "content": t}] for t in texts],
        "token_ids": token_ids,
        "tensors": [torch.tensor(ids) for ids in token_ids],
        "dataset": Dataset.from_dict({"prompt": texts}),
    }
    options = dict(num_sequences=6, max_new_tokens=4, batch_size=4, seed=5, show_progress=False)
    anchors = {form: estimate_fisher(model, tokenizer, prompts, **options) for form, prompts in forms.items()}
    reference = anchors["token_ids"]
    for form, anchor in anchors.items():
        assert anchor.fisher.keys() == reference.fisher.keys(), form
        assert all(torch.equal(anchor.fisher[n], reference.fisher[n]) for n in reference.fisher), form
        assert anchor.metadata["prompts_sha256"] == reference.metadata["prompts_sha256"], form
    other = estimate_fisher(model, tokenizer, ["print the sum", "what is two plus three"], **options)
    assert other.metadata["prompts_sha256"] != reference.metadata["prompts_sha256"]

    metadata = reference.metadata
    assert len(metadata["prompts_sha256"]) == 64 and int(metadata["prompts_sha256"], 16) >= 0
    assert metadata["prompts_sha256"] == hashlib.sha256(
        json.dumps(token_ids, separators=(",", ":")).encode()).hexdigest()
    assert metadata["num_sequences"] == 6 and metadata["num_prompts"] == 2 and metadata["seed"] == 5
    assert metadata["estimator"] == "sequence"
    assert metadata["sampler"] == {"temperature": 1.0, "top_k": None, "top_p": 1.0, "max_new_tokens": 4}
    assert 1 <= metadata["mean_response_tokens"] <= 4
    values = torch.cat([t.flatten() for t in reference.fisher.values()]).double()
    stats = metadata["statistics"]
    assert stats["num_parameters"] == sum(p.numel() for p in model.parameters()) == values.numel()
    assert stats["total_mass"] == pytest.approx(float(values.sum()), rel=1e-9)
    top = sorted(values.tolist(), reverse=True)[: math.ceil(0.01 * len(values))]
    assert stats["top1pct_mass_share"] == pytest.approx(sum(top) / float(values.sum()), rel=1e-9)
    assert 0 < stats["top1pct_mass_share"] < 1
    assert stats["max"] == pytest.approx(float(values.max()), rel=1e-9)


# ----------------------------------------------------------------------------------------------
# 8. EOS: tokens after the first EOS do not count
# ----------------------------------------------------------------------------------------------


def _draws(model, sampler, seed, num_sequences, batch_size, eos_ids, pad_id, max_new_tokens=T):
    pairs = []
    for start in range(0, num_sequences, batch_size):
        batch = [PROMPTS[n % len(PROMPTS)] for n in range(start, min(start + batch_size, num_sequences))]
        generator = batch_generator(seed, start // batch_size)
        drawn = sample_responses(model, batch, sampler, max_new_tokens, eos_ids, pad_id, generator)
        pairs.extend(zip(batch, drawn))
    return pairs


def _reference_on_same_draws(model, sampler, seed, num_sequences, batch_size, eos_ids, pad_id, max_new_tokens=T):
    return ref_mean_squared_score(model, _draws(model, sampler, seed, num_sequences, batch_size, eos_ids, pad_id,
                                                max_new_tokens))


def test_responses_end_at_eos_and_later_tokens_do_not_count():
    eos, max_new = 3, 5
    model = enum_model(seed=4, eos_token_id=eos)
    options = dict(num_sequences=40, batch_size=8, seed=7)
    anchor = estimate_fisher(model, None, PROMPTS, max_new_tokens=max_new, show_progress=False, **options)
    pairs = _draws(model, Sampler(), eos_ids={eos}, pad_id=eos, max_new_tokens=max_new, **options)
    responses = [r for _, r in pairs]
    assert all(eos not in r[:-1] and 1 <= len(r) <= max_new for r in responses)
    assert all(r[-1] == eos for r in responses if len(r) < max_new)
    short = sum(len(r) < max_new for r in responses)
    assert 5 <= short < len(responses)  # EOS cut some responses, others ran to max_new_tokens
    assert anchor.metadata["mean_response_tokens"] == pytest.approx(sum(map(len, responses)) / len(responses))

    reference = ref_mean_squared_score(model, pairs)
    scale = max(float(t.max()) for t in reference.values())
    for name, ref in reference.items():
        torch.testing.assert_close(anchor.fisher[name].double(), ref, rtol=1e-5, atol=1e-7 * scale)
    # Discrimination: scoring past the EOS (padding the cut responses with more tokens) changes it.
    padded = [(p, r + [0] * (max_new - len(r))) for p, r in pairs]
    gap = mass_ratio(flat(ref_mean_squared_score(model, padded), model), flat(reference, model))
    print(f"EOS draws: {short}/{len(responses)} cut; mass with post-EOS tokens scored / true {gap:.3f}")
    assert abs(gap - 1) > 0.1


# ----------------------------------------------------------------------------------------------
# 9. Bad arguments
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [
    dict(num_sequences=0),
    dict(num_sequences=-3),
    dict(num_sequences=2.5),
    dict(prompts=[]),
    dict(prompts=[[]]),
    dict(prompts=[{"not": "a prompt"}]),
    dict(prompts=["text needs a tokenizer"]),
    dict(temperature=0),
    dict(temperature=-1.0),
    dict(top_p=0),
    dict(top_p=1.5),
    dict(top_k=0),
    dict(max_new_tokens=0),
    dict(batch_size=0),
    dict(estimator="bogus"),
    dict(responses=[[1], [2]]),  # responses with the default estimator="sequence"
    dict(estimator="empirical"),  # ...and the empirical estimator without them
    dict(estimator="empirical", responses=[[1]]),  # one response for two prompts
    dict(num_sequences=None),  # wrong types are the library's error too, not a TypeError
    dict(temperature=None),
    dict(top_p=None),
    dict(top_k=2.5),
    dict(max_new_tokens=None),
], ids=lambda kw: ",".join(f"{k}={v!r}" for k, v in kw.items())[:40])
def test_bad_arguments_raise(kwargs):
    model = enum_model()
    options = dict(prompts=PROMPTS, num_sequences=2, max_new_tokens=2, show_progress=False)
    options.update(kwargs)
    prompts = options.pop("prompts")
    with pytest.raises(CFPArgumentError):
        estimate_fisher(model, None, prompts, **options)
    assert all(p.grad is None for p in model.parameters())
