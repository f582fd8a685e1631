"""The batched squared-score engine against the plain per-sequence loop (the independent reference)."""

import copy
import logging
import time

import pytest
import torch
from support.extras import needs
from support.tiny import tiny_llama
from torch import nn
from transformers import GemmaConfig, GemmaForCausalLM, GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

from hf_cfp.fisher.batched import add_batched_squared_scores
from hf_cfp.fisher.sampling import Sampler, sample_responses
from hf_cfp.fisher.scoring import add_squared_score, sequence_log_prob

EOS = 3
RTOL = 1e-5
LOGGER = "hf_cfp.fisher.batched"
PLAIN = Sampler()  # temperature 1, no truncation


def covered(model):
    """Trainable parameters, each once (a tied weight appears once)."""
    seen, params = set(), []
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            params.append(p)
    return params


def names_of(model):
    names = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return names


def loop_reference(model, params, prompts, responses, sampler):
    sums = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    for prompt, response in zip(prompts, responses, strict=True):
        add_squared_score(sums, params, sequence_log_prob(model, prompt, response, sampler))
    return sums


def batched(model, params, prompts, responses, sampler, **kwargs):
    sums = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    add_batched_squared_scores(model, params, sums, prompts, responses, sampler, **kwargs)
    return sums


def max_rel(got, want):
    """max |got - want| over the tensor, relative to max |want|."""
    scale = want.abs().max()
    return float((got - want).abs().max() / scale) if scale > 0 else float(got.abs().max())


def assert_exact(model, prompts, responses, sampler=PLAIN, **kwargs) -> float:
    """Batched == loop within RTOL per tensor; returns the worst relative difference."""
    params = covered(model)
    want = loop_reference(model, params, prompts, responses, sampler)
    got = batched(model, params, prompts, responses, sampler, **kwargs)
    names = names_of(model)
    worst = 0.0
    for p, g, w in zip(params, got, want, strict=True):
        assert w.abs().max() > 0, f"{names[id(p)]}: reference is all zero, the test would not discriminate"
        rel = max_rel(g, w)
        assert rel <= RTOL, f"{names[id(p)]}: max relative difference {rel:.2e}"
        worst = max(worst, rel)
    assert all(p.grad is None for p in model.parameters())
    assert all(not m._forward_hooks for m in model.modules())
    assert not any(g.requires_grad for g in got)
    print(f"\n{type(model).__name__}: {len(params)} tensors, max relative difference {worst:.2e}")
    return worst


def ragged_batch(vocab=32, seed=0, prompt_lengths=(3, 1, 6, 2, 4), response_lengths=(5, 7, 1, 3, 6)):
    """Unequal prompt and response lengths; most responses end with the EOS token."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, vocab, (n,), generator=g).tolist() for n in prompt_lengths]
    responses = [torch.randint(4, vocab, (n,), generator=g).tolist() for n in response_lengths]
    for r in responses[:-1]:
        r[-1] = EOS
    return prompts, responses


def no_fallback(caplog):
    return not [r for r in caplog.records if r.name == LOGGER]


def tiny_gpt2():
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=32, n_embd=16, n_layer=2, n_head=2, n_positions=64, bos_token_id=None, eos_token_id=None
    )
    return GPT2LMHeadModel(config).eval()


def tiny_qwen2(tie=False):
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
        bos_token_id=None,
        eos_token_id=None,
    )
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # non-trivial biases
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    return model


@pytest.mark.parametrize("tie", [False, True])
def test_llama_matches_loop(tie, caplog):
    model = tiny_llama(tie=tie).eval()
    model.model.embed_tokens.padding_idx = 5  # token 5 gets no embedding gradient, in both engines
    prompts, responses = ragged_batch()
    prompts[0][0] = responses[1][0] = 5
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert_exact(model, prompts, responses, pad_id=0)
    assert no_fallback(caplog)


def test_llama_sampled_with_truncating_sampler(caplog):
    """Responses drawn from a tempered top-k / top-p sampler and scored under that sampler."""
    model = tiny_llama(seed=1).eval()
    prompts, _ = ragged_batch(seed=1)
    sampler = Sampler(temperature=0.8, top_k=12, top_p=0.9)
    responses = sample_responses(model, prompts, sampler, 6, {EOS}, 0, torch.Generator().manual_seed(0))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert_exact(model, prompts, responses, sampler)
    assert no_fallback(caplog)


def test_gpt2_conv1d_layernorm_tied(caplog):
    model = tiny_gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    prompts, responses = ragged_batch()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert_exact(model, prompts, responses)
    assert no_fallback(caplog)


@pytest.mark.parametrize("tie", [False, True])
def test_qwen2_with_biases(tie, caplog):
    model = tiny_qwen2(tie)
    prompts, responses = ragged_batch()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert_exact(model, prompts, responses)
    assert no_fallback(caplog)


def test_gemma_one_plus_weight_norm(caplog):
    """Gemma's RMSNorm computes x_hat * (1 + w): affine in w with a nonzero offset, found by the probe."""
    torch.manual_seed(0)
    config = GemmaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=64,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = GemmaForCausalLM(config).eval()
    with torch.no_grad():  # Gemma norms start at w = 0
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)
    prompts, responses = ragged_batch()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert_exact(model, prompts, responses)
    assert no_fallback(caplog)


def test_peft_lora(caplog):
    needs("peft")
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        tiny_llama(), LoraConfig(r=2, lora_alpha=4, lora_dropout=0.1, target_modules=["q_proj", "v_proj", "down_proj"])
    )
    model.eval()
    with torch.no_grad():  # lora_B starts at zero, which would make every lora_A score zero
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    params = covered(model)
    assert params and all("lora_" in names_of(model)[id(p)] for p in params)
    prompts, responses = ragged_batch()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert_exact(model, prompts, responses)
    assert no_fallback(caplog)


def test_chunking_does_not_change_the_result_bit_for_bit():
    """Squares are added one sequence at a time in sequence order, so the chunk size (chosen from the
    available memory by default) cannot change the anchor: one sequence per chunk, two, all at once."""
    model = tiny_llama(tie=True).eval()
    prompts, responses = ragged_batch()
    params = covered(model)
    whole = batched(model, params, prompts, responses, Sampler(), max_chunk_elements=10**9)
    for chunk in (1, 600, None):
        chunked = batched(model, params, prompts, responses, Sampler(), max_chunk_elements=chunk)
        assert all(torch.equal(a, b) for a, b in zip(chunked, whole, strict=True)), chunk
    assert_exact(model, prompts, responses, max_chunk_elements=1)


class Tweak(nn.Module):
    """A module the engine does not know: a raw scalar gain, and a Linear whose weight the parent
    also reads directly (a use outside the Linear's own forward, which hooks alone would miss)."""

    def __init__(self, inner, hidden):
        super().__init__()
        self.inner = inner
        self.gain = nn.Parameter(torch.tensor(1.3))
        self.mix = nn.Linear(hidden, hidden)

    def forward(self, x):
        y = self.inner(x) * self.gain
        return y + 0.5 * nn.functional.linear(y, self.mix.weight) + self.mix(y)


class Twice(nn.Module):
    """Calls the same Linear twice per forward: its per-sequence gradients must be summed before squaring."""

    def __init__(self, linear):
        super().__init__()
        self.linear = linear

    def forward(self, x):
        return self.linear(x) + 0.5 * self.linear(x.flip(-1))


def test_unknown_module_falls_back_exactly_with_one_log_line(caplog):
    model = tiny_llama().eval()
    torch.manual_seed(1)
    model.model.norm = Tweak(model.model.norm, 16)
    model.model.layers[0].mlp.down_proj = Twice(model.model.layers[0].mlp.down_proj)
    prompts, responses = ragged_batch()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert_exact(model, prompts, responses)
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 1, lines
    assert "model.norm.gain" in lines[0] and "model.norm.mix.weight" in lines[0]
    for covered_name in ("model.norm.mix.bias", "model.norm.inner.weight", "down_proj"):
        assert covered_name not in lines[0]


class InPlace(nn.Module):
    """Scales a Linear's output in place after the Linear returned it."""

    def __init__(self, linear):
        super().__init__()
        self.linear = linear

    def forward(self, x):
        return self.linear(x).mul_(2.0)


def test_output_modified_in_place_falls_back(caplog):
    model = tiny_llama().eval()
    model.model.layers[1].mlp.up_proj = InPlace(model.model.layers[1].mlp.up_proj)
    prompts, responses = ragged_batch()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert_exact(model, prompts, responses)
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 1 and "model.layers.1.mlp.up_proj.linear.weight" in lines[0], lines


def test_tied_weight_is_summed_before_squaring():
    """The tied embedding/lm_head gets (G_embed + G_head)^2; squaring the two uses separately
    (G_embed^2 + G_head^2, measured on an untied copy with equal values) is far from it."""
    tied = tiny_llama(tie=True).eval()
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    prompts, responses = ragged_batch()
    untied = copy.deepcopy(tied)
    untied.lm_head.weight = nn.Parameter(untied.model.embed_tokens.weight.detach().clone())
    embed, head = untied.model.embed_tokens.weight, untied.lm_head.weight
    separate = loop_reference(untied, [embed, head], prompts, responses, Sampler())
    separately_squared = separate[0] + separate[1]

    weight = tied.model.embed_tokens.weight
    got = batched(tied, [weight], prompts, responses, Sampler())[0]
    want = loop_reference(tied, [weight], prompts, responses, Sampler())[0]
    assert max_rel(got, want) <= RTOL
    assert max_rel(separately_squared, want) > 1e-2  # the check above tells the two apart
    assert max_rel(got, separately_squared) > 1e-2


def test_hooks_removed_and_no_grad_even_on_error():
    model = tiny_llama().eval()
    params = covered(model)
    sums = [torch.zeros_like(p) for p in params]
    with pytest.raises(IndexError):  # token id outside the vocabulary fails inside the forward
        add_batched_squared_scores(model, params, sums, [[1, 2]], [[99]], Sampler())
    assert all(not m._forward_hooks for m in model.modules())
    assert all(p.grad is None for p in model.parameters())
    assert all(float(s.abs().sum()) == 0 for s in sums)


def test_empty_responses_and_frozen_params():
    model = tiny_llama().eval()
    params = covered(model)
    sums = [torch.zeros_like(p) for p in params]
    add_batched_squared_scores(model, params, sums, [[1, 2]], [[]], Sampler())
    assert all(float(s.abs().sum()) == 0 for s in sums)
    prompts, responses = ragged_batch()
    model.model.layers[1].requires_grad_(False)  # only what requires grad is scored
    live = [p for p in params if p.requires_grad]
    frozen_sums = batched(model, params, prompts, responses, Sampler())
    want = loop_reference(model, live, prompts, responses, Sampler())
    got = [s for s, p in zip(frozen_sums, params, strict=True) if p.requires_grad]
    assert all(max_rel(g, w) <= RTOL for g, w in zip(got, want, strict=True))
    assert all(float(s.abs().sum()) == 0 for s, p in zip(frozen_sums, params, strict=True) if not p.requires_grad)


def test_speed_vs_loop_at_batch_16():
    """Prints, does not assert, the time of the batched engine, the per-sequence loop and a plain
    batched forward+backward (the floor) on the tiny Llama at B = 16."""
    model = tiny_llama().eval()
    params = covered(model)
    prompts, responses = ragged_batch(prompt_lengths=[8] * 16, response_lengths=[24] * 16, seed=3)
    sampler = Sampler()

    def plain():
        ids = torch.tensor([p + r for p, r in zip(prompts, responses, strict=True)])
        log_probs = model(input_ids=ids).logits[:, 7:-1].log_softmax(-1)
        torch.autograd.grad(log_probs.gather(-1, ids[:, 8:, None]).sum(), params)

    def best(fn, repeats=3):
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    engine = best(lambda: batched(model, params, prompts, responses, sampler), repeats=5)
    loop = best(lambda: loop_reference(model, params, prompts, responses, sampler))
    floor = best(plain, repeats=5)
    worst = max(
        max_rel(g, w)
        for g, w in zip(
            batched(model, params, prompts, responses, sampler),
            loop_reference(model, params, prompts, responses, sampler),
            strict=True,
        )
    )
    print(
        f"\nB=16 tiny Llama: engine {engine * 1e3:.1f} ms, loop {loop * 1e3:.1f} ms, "
        f"plain fwd+bwd {floor * 1e3:.1f} ms; loop/engine {loop / engine:.1f}x, "
        f"engine/fwd+bwd {engine / floor:.2f}x, max rel diff {worst:.1e}"
    )
    assert worst <= RTOL
