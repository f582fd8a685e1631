"""Tiny models and a tiny tokenizer built in memory: nothing is downloaded."""

import torch
from transformers import PreTrainedTokenizerFast

from hf_cfp.demo.models import tiny_llama  # the one tiny-model builder (demo, scripts, tests)

__all__ = ["CHAT_TEMPLATE", "anchor_for", "tiny_llama", "tiny_tokenizer", "torchrun"]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tiny_tokenizer(vocab_size=300):
    """A byte-level BPE trained on a few synthetic sentences, with pad/eos tokens and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    special = ["<unk>", "<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    words = ["two", "plus", "three", "is", "five", "what", "the", "answer", "code", "print", "sum"]
    corpus = [" ".join(words[(i * k) % len(words)] for k in range(1, 8)) for i in range(200)]
    tokenizer.train_from_iterator(corpus, trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def anchor_for(model, name="math", seed=0):
    """A FisherAnchor of uniform random values over every parameter of `model`."""
    from hf_cfp import FisherAnchor

    g = torch.Generator().manual_seed(seed)
    return FisherAnchor(
        {n: torch.rand(p.shape, generator=g) for n, p in model.named_parameters()},
        name=name,
        metadata={"base_model": "org/base"},
    )


def torchrun(script, *args, nproc: int = 2, timeout: int = 300, env: dict | None = None):
    """Run `script` on `nproc` CPU processes with torch.distributed.run on a free port (extra
    environment `env`); returns the CompletedProcess (stdout/stderr captured)."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as probe:  # a free port now; fixed ports collide with concurrent runs
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **(env or {})}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    command += ["--master_addr", "127.0.0.1", "--master_port", str(port), str(script), *map(str, args)]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
