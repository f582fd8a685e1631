"""Anchors for tests: random ones with a share of exact zeros (uniform ones: `support.tiny.anchor_for`),
and an exact comparison of two anchors."""

import torch

from hf_cfp import FisherAnchor, estimate_fisher


def random_anchor(model, name="math", seed=1, zero_fraction=0.3):
    """F ~ |N(0,1)| * 3 with a share of exact zeros, over every trainable parameter."""
    g = torch.Generator().manual_seed(seed)
    fisher = {}
    for n, p in model.named_parameters():
        f = torch.randn(p.shape, generator=g).abs() * 3
        f[torch.rand(p.shape, generator=g) < zero_fraction] = 0.0
        fisher[n] = f
    return FisherAnchor(fisher, name=name)


def small_estimate(model, prompts, name, structure="kfac", rank=None, seed=0):
    """A tiny anchor estimated on `prompts` (6 sequences of 4 new tokens, batch 3; no tokenizer): `structure`,
    `kfac_rank=rank`."""
    return estimate_fisher(
        model,
        None,
        prompts,
        num_sequences=6,
        max_new_tokens=4,
        batch_size=3,
        seed=seed,
        structure=structure,
        kfac_rank=rank,
        show_progress=False,
        name=name,
    )


def same_anchor(a, b):
    """The same tensor names and bit-identical values."""
    return a.fisher.keys() == b.fisher.keys() and all(torch.equal(a.fisher[n], b.fisher[n]) for n in a.fisher)
