"""A Linear called on gathered tokens (an MoE expert, `expert(hidden.view(-1, H)[token_idx])`) is not
batch-first even when the number of routed tokens equals the batch size: estimate_fisher's batched
engine must give the loop engine's anchor (the exact per-sequence reference), with one log line."""

import logging

import torch
from support.tiny import tiny_llama
from torch import nn

from hf_cfp import estimate_fisher

LOGGER = "hf_cfp.fisher.batched"
VOCAB, HIDDEN, ROUTED = 24, 16, 23  # token ROUTED goes to expert 0, every other token to expert 1


class HashRoutedExperts(nn.Module):
    """An MoE layer routed by token id (as in hash layers): h = embed(ids), then every token's hidden
    state gets the output of its expert, each expert called on its gathered tokens."""

    def __init__(self, embed):
        super().__init__()
        self.embed = embed
        self.experts = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(2))

    def forward(self, ids):
        hidden = self.embed(ids)
        flat = hidden.view(-1, HIDDEN)
        expert_of = (ids.reshape(-1) != ROUTED).long()
        for e, expert in enumerate(self.experts):
            token_idx = (expert_of == e).nonzero().squeeze(1)
            flat = flat.index_add(0, token_idx, expert(flat[token_idx]))
        return flat.view_as(hidden)


def moe_llama():
    """tiny_llama with hash-routed experts after the embedding; the output head never draws ROUTED
    (bias -1e4: probability exactly 0), so only the prompts route tokens to expert 0."""
    model = tiny_llama(vocab_size=VOCAB, hidden_size=HIDDEN, seed=2)
    model.model.embed_tokens = HashRoutedExperts(model.model.embed_tokens)
    head = nn.Linear(HIDDEN, VOCAB)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight * 20)  # logits of order 1, not 0.01
        head.bias.normal_(0, 0.5)[ROUTED] = -1e4
    model.lm_head = head
    return model


def test_expert_on_as_many_gathered_tokens_as_sequences_matches_the_loop(caplog):
    """Every batch holds the prompts [ROUTED, ROUTED, 1, 2] and [3, 4]: expert 0 gets 2 tokens for 2
    sequences, both from the first one; their gradients must be summed before squaring."""
    model = moe_llama()
    prompts = [[ROUTED, ROUTED, 1, 2], [3, 4]]
    options = dict(num_sequences=8, max_new_tokens=4, batch_size=2, seed=0, show_progress=False)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        batched = estimate_fisher(model, None, prompts, engine="batched", **options)
    loop = estimate_fisher(model, None, prompts, engine="loop", **options)
    for name, want in loop.fisher.items():
        assert want.abs().max() > 0, f"{name}: reference is all zero, the test would not discriminate"
        torch.testing.assert_close(batched.fisher[name], want, rtol=1e-5, atol=1e-6 * float(want.max()), msg=name)
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 1, lines
    assert "experts.0.weight" in lines[0] and "experts.1.bias" in lines[0]
    assert "layers" not in lines[0] and "lm_head" not in lines[0]  # the rest stays batched
