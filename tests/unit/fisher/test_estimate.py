"""estimate_fisher against independent references.

The references never call hf_cfp's scoring code: exact Fishers come from enumerating every
response of a tiny model (tests/support/enumeration.py: a prefix tree of plain forwards, the
sampler distribution written out by hand, per-response scores from torch.autograd.grad), the
empirical / EOS cases are checked against plain loops, and the token estimator, the engines and
the prompt schedule against plain references. The sampler itself is checked against plain Python
and transformers' logits warpers in test_sampling.py, the prompt forms in test_prompts.py.

Monte Carlo tolerances (5% on the total mass, Pearson >= 0.95 across coordinates) were sized from
the exact per-sequence variance of the enumeration model (`enum_model`): with N_MC = 2000 the relative standard
deviation of the total mass is about 1.3-1.6%, so 5% is more than 3 sigma, while every "must differ"
assertion is a gap of 25% or more.

Reliability (issue 6): a tokenizer without a pad token, a model that cannot generate.
"""

import itertools

import pytest
import torch
from support.enumeration import PROMPTS, T, V, all_responses, enum_model, exact_fisher, flat, mass_ratio, pearson
from support.references import ref_sequence_score
from support.tiny import tiny_llama, tiny_tokenizer

from hf_cfp import estimate_fisher
from hf_cfp.errors import CFPArgumentError
from hf_cfp.fisher.calibration import scoring_groups
from hf_cfp.fisher.sampling import Sampler, batch_generator, sample_responses

N_MC = 2000
MC_BATCH = 64
MASS_TOL = 0.05
MIN_CORR = 0.95


def ref_mean_squared_score(model, pairs):
    names = [n for n, _ in model.named_parameters()]
    sums = None
    for prompt, response in pairs:
        g = ref_sequence_score(model, prompt, response)
        sums = [x**2 for x in g] if sums is None else [s + x**2 for s, x in zip(sums, g, strict=True)]
    return {n: s / len(pairs) for n, s in zip(names, sums, strict=True)}


def mc_estimate(model, **kwargs):
    anchor = estimate_fisher(
        model,
        None,
        PROMPTS,
        num_sequences=N_MC,
        max_new_tokens=T,
        batch_size=MC_BATCH,
        seed=0,
        show_progress=False,
        **kwargs,
    )
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

            def log_pi(y, prompt=prompt):
                logits = model(input_ids=torch.tensor([prompt + list(y)])).logits[0].double()
                return sum(float(logits[len(prompt) - 1 + t].log_softmax(0)[y[t]]) for t in range(T))

            scored = sorted(all_responses(V, T), key=log_pi)
            rare.append(list(scored[0]))
            modal.append(list(scored[-1]))

    for labels, direction in ((rare, "rare"), (modal, "modal")):
        anchor = estimate_fisher(
            model,
            None,
            PROMPTS,
            num_sequences=4,
            max_new_tokens=T,
            estimator="empirical",
            responses=labels,
            show_progress=False,
        )
        reference = ref_mean_squared_score(model, list(zip(PROMPTS, labels, strict=True)))
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


@pytest.mark.parametrize("engine", ["batched", "loop"])
def test_squares_each_sequence_score_not_the_batch_sum(engine):
    """F = (1/N) sum_b g_b^2 with g_b one sequence's score. On-policy, (sum_b g_b)^2 has the same
    expectation (the cross terms g_b g_c vanish), so the enumeration tests cannot tell the two apart;
    on fixed responses scored in one batch they differ coordinate by coordinate. The reference is a
    plain loop over the sequences, one torch.autograd.grad each (`ref_sequence_score`). Tokens are
    shared between sequences, so that embedding rows get several sequences' scores too."""
    model = tiny_llama(vocab_size=24, seed=5)
    prompts = [[1, 2, 3], [4, 2], [6, 7, 3, 9]]
    responses = [[10, 11, 12], [13, 11], [12, 16, 10, 11]]
    anchor = estimate_fisher(
        model,
        None,
        prompts,
        num_sequences=3,
        batch_size=3,  # the three sequences in one batch: one call of the engine
        max_new_tokens=4,
        estimator="empirical",
        responses=responses,
        engine=engine,
        show_progress=False,
    )
    scores = [ref_sequence_score(model, p, r) for p, r in zip(prompts, responses, strict=True)]
    names = [n for n, _ in model.named_parameters()]
    per_sequence = {n: sum(g[i] ** 2 for g in scores) / 3 for i, n in enumerate(names)}
    batch_sum = {n: sum(g[i] for g in scores) ** 2 / 3 for i, n in enumerate(names)}  # (sum_b g_b)^2 / N

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    # the test can tell them apart in every tensor (also were the batch sum divided by B once more)
    gap = min(rel(w, per_sequence[n]) for n in names for w in (batch_sum[n], batch_sum[n] / 3))
    error = max(rel(anchor.fisher[n].double(), per_sequence[n]) for n in names)
    print(f"{engine}: max relative L2 error per tensor {error:.2e}; the batch sum squared: >= {gap:.2f} away")
    assert gap > 0.25
    assert error < 1e-5  # float32 accumulation of float32 scores: ~3e-7 seen
    for name in names:
        ref = per_sequence[name]
        torch.testing.assert_close(anchor.fisher[name].double(), ref, rtol=1e-5, atol=1e-7 * float(ref.max()))


# ----------------------------------------------------------------------------------------------
# 5. The token estimator, the engines and the prompt schedule
# ----------------------------------------------------------------------------------------------


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
                largest_pointwise_gap = max(
                    largest_pointwise_gap, float((h**2 - sum(x[i] ** 2 for x in xis)).abs().max())
                )
    seq, tok = torch.cat([s.flatten() for s in sequence]), torch.cat([t.flatten() for t in token])
    torch.testing.assert_close(tok, seq, rtol=1e-6, atol=1e-9 * float(seq.max()))
    assert largest_pointwise_gap > 1e-2 * float(seq.max())  # the identity holds only in expectation


def test_token_estimator_matches_the_exact_fisher(tmp_path):
    model = enum_model()
    exact = flat(exact_fisher(model, PROMPTS), model)
    anchor = estimate_fisher(
        model,
        None,
        PROMPTS,
        num_sequences=2000,
        max_new_tokens=T,
        batch_size=64,
        seed=0,
        estimator="token",
        show_progress=False,
    )
    ratio, corr = mass_ratio(flat(anchor, model), exact), pearson(flat(anchor, model), exact)
    print(f"token estimator: mass ratio {ratio:.4f}, Pearson {corr:.4f}")
    assert abs(ratio - 1) < 0.05 and corr >= 0.95
    assert anchor.metadata["estimator"] == "token"


def test_token_estimator_equals_a_per_token_loop_on_the_same_draws():
    model = tiny_llama(vocab_size=16, seed=2)
    prompts, n, batch = [[1, 2, 3], [4, 5]], 6, 3
    anchor = estimate_fisher(
        model,
        None,
        prompts,
        num_sequences=n,
        max_new_tokens=4,
        batch_size=batch,
        seed=5,
        estimator="token",
        show_progress=False,
    )
    reference = [torch.zeros_like(p, dtype=torch.float64) for p in model.parameters()]
    for k in range(n // batch):
        batch_prompts = [prompts[i % 2] for i in range(k * batch, (k + 1) * batch)]
        for prompt, response in zip(
            batch_prompts,
            sample_responses(model.eval(), batch_prompts, Sampler(), 4, set(), 0, batch_generator(5, k)),
            strict=True,
        ):
            for xi in _scores(model, prompt, response):
                for r, x in zip(reference, xi, strict=True):
                    r += x**2 / n
    for (name, _), ref in zip(model.named_parameters(), reference, strict=True):
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
        reference = _reference_on_same_draws(
            model, Sampler(), seed=0, num_sequences=24, batch_size=8, eos_ids=set(), pad_id=0
        )
    finally:
        frozen.requires_grad_(False)
    torch.testing.assert_close(
        everything.fisher[frozen_name].double(),
        reference[frozen_name],
        rtol=1e-5,
        atol=1e-7 * float(reference[frozen_name].max()),
    )


# ----------------------------------------------------------------------------------------------
# 7. EOS: tokens after the first EOS do not count
# ----------------------------------------------------------------------------------------------


def _draws(model, sampler, seed, num_sequences, batch_size, eos_ids, pad_id, max_new_tokens=T):
    pairs = []
    for start in range(0, num_sequences, batch_size):
        batch = [PROMPTS[n % len(PROMPTS)] for n in range(start, min(start + batch_size, num_sequences))]
        generator = batch_generator(seed, start // batch_size)
        drawn = sample_responses(model, batch, sampler, max_new_tokens, eos_ids, pad_id, generator)
        pairs.extend(zip(batch, drawn, strict=True))
    return pairs


def _reference_on_same_draws(model, sampler, seed, num_sequences, batch_size, eos_ids, pad_id, max_new_tokens=T):
    return ref_mean_squared_score(
        model, _draws(model, sampler, seed, num_sequences, batch_size, eos_ids, pad_id, max_new_tokens)
    )


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
# 8. Bad arguments
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
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
    ],
    ids=lambda kw: ",".join(f"{k}={v!r}" for k, v in kw.items())[:40],
)
def test_bad_arguments_raise(kwargs):
    model = enum_model()
    options = dict(prompts=PROMPTS, num_sequences=2, max_new_tokens=2, show_progress=False)
    options.update(kwargs)
    prompts = options.pop("prompts")
    with pytest.raises(CFPArgumentError):
        estimate_fisher(model, None, prompts, **options)
    assert all(p.grad is None for p in model.parameters())


# ----------------------------------------------------------------------------------------------
# 9. Bad inputs: a tokenizer without a pad token, a model that cannot generate
# ----------------------------------------------------------------------------------------------


TEXT_PROMPTS = ["two plus three", "what is the answer to the sum code print five"]  # different lengths: padded


def _estimate_text(model, tokenizer, **kwargs):
    options = dict(num_sequences=4, max_new_tokens=4, batch_size=2, seed=0, show_progress=False)
    return estimate_fisher(model, tokenizer, TEXT_PROMPTS, **{**options, **kwargs})


@pytest.mark.parametrize("engine", ["batched", "loop"])
def test_tokenizer_without_pad_token_is_handled_and_gives_the_same_anchor(engine):
    with_pad = tiny_tokenizer()
    without_pad = tiny_tokenizer()
    without_pad.pad_token = None
    assert without_pad.pad_token_id is None and with_pad.pad_token_id is not None
    model = tiny_llama(vocab_size=len(with_pad))
    reference = _estimate_text(model, with_pad, engine=engine)
    anchor = _estimate_text(model, without_pad, engine=engine)  # padding is masked: the pad id is irrelevant
    assert anchor.fisher.keys() == reference.fisher.keys()
    assert all(torch.equal(anchor.fisher[n], reference.fisher[n]) for n in anchor.fisher)
    assert all(t.sum() > 0 for t in anchor.fisher.values() if t.numel() > 0)
    assert without_pad.pad_token is None  # the caller's tokenizer is not modified


def test_tokenizer_without_pad_or_eos_token_is_handled():
    tokenizer = tiny_tokenizer()
    tokenizer.pad_token, tokenizer.eos_token = None, None
    model = tiny_llama(vocab_size=len(tokenizer))
    anchor = _estimate_text(model, tokenizer)
    assert all(torch.isfinite(t).all() for t in anchor.fisher.values())
    assert anchor.metadata["mean_response_tokens"] == 4  # no EOS: every response runs to max_new_tokens


class _NoLogits(torch.nn.Module):
    """Takes input_ids but returns a plain dict (an encoder, a value head...)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(400, 8)

    def forward(self, input_ids=None, **kwargs):
        return {"hidden_states": self.embed(input_ids)}


class _Raises(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, *args, **kwargs):
        raise RuntimeError("this model cannot run")


class _SequenceClassifier(torch.nn.Module):
    """Returns .logits, but per sequence (batch, labels), not per token."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(400, 3)

    def forward(self, input_ids=None, **kwargs):
        from transformers.modeling_outputs import SequenceClassifierOutput

        return SequenceClassifierOutput(logits=self.embed(input_ids).mean(1))


class _NoCache(torch.nn.Module):
    """A causal LM forward (per-token logits) with no KV cache and no generate()."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(400, 400)

    def forward(self, input_ids=None, **kwargs):
        from transformers.modeling_outputs import CausalLMOutput

        return CausalLMOutput(logits=self.embed(input_ids))


@pytest.mark.parametrize(
    "model, words",
    [
        (_NoLogits(), "returned dict"),
        (_Raises(), "RuntimeError: this model cannot run"),
        (torch.nn.Linear(3, 3), "calling Linear failed"),
        (_SequenceClassifier(), "logits of shape (1, 3)"),
        (torch.nn.Module(), "has no parameters"),
    ],
)
@pytest.mark.parametrize("estimator", ["sequence", "empirical"])
def test_a_model_that_cannot_generate_gets_a_clear_error(model, words, estimator):
    extra = {"responses": ["five", "five"]} if estimator == "empirical" else {}
    with pytest.raises(CFPArgumentError, match="needs a causal language model") as caught:
        _estimate_text(model, tiny_tokenizer(), estimator=estimator, **extra)
    assert words in str(caught.value) and ".logits" in str(caught.value)


def test_a_model_without_generate_gets_a_clear_error_when_sampling():
    with pytest.raises(CFPArgumentError, match=r"_NoCache has no generate\(\).*AutoModelForCausalLM"):
        _estimate_text(_NoCache(), tiny_tokenizer())


def test_scoring_groups_follow_the_token_budget():
    """Groups of consecutive sequences with (count x longest length) <= scoring_tokens, at most batch_size,
    checked against a brute-force reading of the rule; a sequence over the budget is alone."""
    lengths = [(3, 5), (2, 2), (6, 20), (1, 1), (2, 3), (4, 4), (1, 2)]  # (prompt, response) lengths
    prompts = [[1] * p for p, _ in lengths]
    responses = [[2] * r for _, r in lengths]
    groups = scoring_groups(prompts, responses, batch_size=3, scoring_tokens=16)
    assert groups == [slice(0, 2), slice(2, 3), slice(3, 5), slice(5, 7)]
    for group in groups:
        size = group.stop - group.start
        width = max(p + r for p, r in lengths[group])
        assert size == 1 or (size <= 3 and size * width <= 16)
    assert [slice(0, 3), slice(3, 6), slice(6, 7)] == scoring_groups(prompts, responses, 3, 10**6)


def test_scoring_tokens_do_not_change_the_anchor_beyond_rounding():
    """One sequence per forward and the whole batch per forward score the same draws: equal to float rounding."""
    model = tiny_llama(vocab_size=16, hidden_size=8).eval()
    prompts = [[1, 2], [3], [4, 5, 6], [7]]
    kwargs = dict(num_sequences=8, max_new_tokens=5, batch_size=4, seed=1, show_progress=False)
    one = estimate_fisher(model, None, prompts, scoring_tokens=1, **kwargs)
    whole = estimate_fisher(model, None, prompts, scoring_tokens=10**6, **kwargs)
    for name, f in whole.fisher.items():
        assert torch.allclose(one.fisher[name], f, rtol=1e-5, atol=1e-12 * float(f.abs().max())), name
