"""isotropic_anchor: F replaced by its mean over all the anchor's coordinates (a float64 plain loop here), and
CFPCallback with it through a Trainer against the closed form theta0 + Delta / (1 + lam * mean) applied by hand
after each step of the same AdamW (support.training.adamw_loop)."""

import copy

import pytest
import torch
from evidence import isotropic_anchor
from support.anchors import random_anchor
from support.tiny import tiny_llama
from support.training import adamw_loop, full_batch_rows, full_batch_trainer_args
from transformers import Trainer

from hf_cfp import CFPCallback, FisherAnchor
from hf_cfp.anchor import model_fingerprint


def plain_mean(anchor):
    """(1/n) sum_j F_j, one coordinate at a time in float64."""
    total, count = 0.0, 0
    for tensor in anchor.fisher.values():
        for value in tensor.double().reshape(-1).tolist():
            total += value
            count += 1
    return total / count


def test_values_are_the_mean_over_all_coordinates_with_names_shapes_and_metadata_kept():
    model = tiny_llama(hidden_size=8, layers=1)
    fisher = random_anchor(model).fisher
    anchor = FisherAnchor(fisher, name="math", metadata={"base_model": "org/base", "base_fingerprint": {"x": 1}})
    iso = isotropic_anchor(anchor)
    mean = plain_mean(anchor)
    assert iso.name == "isotropic"
    assert list(iso.fisher) == list(anchor.fisher)
    for name, tensor in iso.fisher.items():
        assert tensor.shape == anchor.fisher[name].shape and tensor.dtype == torch.float32
        assert torch.equal(tensor, torch.full_like(tensor, mean))  # float64 mean, rounded once to float32
    assert iso.metadata["base_model"] == "org/base" and iso.metadata["base_fingerprint"] == {"x": 1}
    assert iso.metadata["derived_from"] == "math" and iso.metadata["transform"] == "isotropic mean"
    iso_mass = sum(float(t.double().sum()) for t in iso.fisher.values())
    assert iso_mass == pytest.approx(sum(float(t.double().sum()) for t in anchor.fisher.values()), rel=1e-6)
    assert isotropic_anchor(anchor, name="iso-math").name == "iso-math"


def test_cfp_with_the_isotropic_anchor_is_the_closed_form_per_step(tmp_path):
    lam, steps, rows = 3.0, 4, full_batch_rows()
    model = tiny_llama()
    anchor = random_anchor(model)
    anchor.metadata["base_fingerprint"] = model_fingerprint(model)  # binds to this model, as estimate_fisher's do
    iso = isotropic_anchor(anchor)
    mean = plain_mean(anchor)
    reference = copy.deepcopy(model)

    args = full_batch_trainer_args(tmp_path, rows, steps)
    Trainer(model=model, args=args, train_dataset=rows, callbacks=[CFPCallback(iso, lam=lam)]).train()

    theta0 = {n: p.detach().double().clone() for n, p in reference.named_parameters()}

    def closed_form():
        with torch.no_grad():
            for n, p in reference.named_parameters():
                p.copy_(theta0[n] + (p.double() - theta0[n]) / (1 + lam * mean))

    adamw_loop(reference, rows, steps, after_step=closed_form)
    for (n, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), n
    moved = sum(float((p.detach() - theta0[n].float()).abs().sum()) for n, p in model.named_parameters())
    assert moved > 0
