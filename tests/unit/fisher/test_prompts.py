"""Every prompt form (strings, chat messages, token ids, tensors, a Dataset) gives the same anchor,
and the anchor's metadata (prompts hash, sampler, statistics) is consistent with it."""

import hashlib
import json
import math

import pytest
import torch
from support.tiny import tiny_llama, tiny_tokenizer

from hf_cfp import estimate_fisher
from hf_cfp.imports import is_available


def test_prompt_forms_give_the_same_anchor_and_metadata_is_consistent():
    tokenizer = tiny_tokenizer()
    assert len(tokenizer) <= 320
    model = tiny_llama(vocab_size=320, hidden_size=8, layers=1, initializer_range=0.3)
    texts = ["what is two plus three", "print the sum"]
    # The chat template written out by hand (tests/support/tiny.py), tokenized without extra specials.
    token_ids = [tokenizer(f"<|user|>{t}<|end|><|assistant|>", add_special_tokens=False)["input_ids"] for t in texts]
    assert token_ids[0][0] == tokenizer.convert_tokens_to_ids("<|user|>")
    assert token_ids[0][-1] == tokenizer.convert_tokens_to_ids("<|assistant|>")
    forms = {
        "strings": texts,
        "messages": [[{"role": "user", "content": t}] for t in texts],
        "token_ids": token_ids,
        "tensors": [torch.tensor(ids) for ids in token_ids],
    }
    if is_available("datasets"):  # the `trl` extra; every other form is compared without it
        from datasets import Dataset

        forms["dataset"] = Dataset.from_dict({"prompt": texts})
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
    assert (
        metadata["prompts_sha256"] == hashlib.sha256(json.dumps(token_ids, separators=(",", ":")).encode()).hexdigest()
    )
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
