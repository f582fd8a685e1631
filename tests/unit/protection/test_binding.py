"""Binding an anchor to a live model: names missing from the model and other shapes are refused by
name, frozen parameters are left alone."""

import pytest
import torch
from support.tiny import anchor_for, tiny_llama

from hf_cfp import FisherAnchor
from hf_cfp.errors import AnchorMismatchError
from hf_cfp.protection import CFPState


def test_binding_refuses_missing_names_and_other_shapes():
    model = tiny_llama()
    anchor = anchor_for(model)
    missing = FisherAnchor({**anchor.fisher, "model.layers.9.mlp.up_proj.weight": torch.ones(2)}, name="m")
    with pytest.raises(AnchorMismatchError, match=r"'model\.layers\.9\.mlp\.up_proj\.weight'.*does not have"):
        CFPState(model, missing)
    wrong = dict(anchor.fisher)
    wrong["model.norm.weight"] = torch.ones(7)
    with pytest.raises(AnchorMismatchError, match=r"'model\.norm\.weight' has shape \(7,\) in the anchor but \(16,\)"):
        CFPState(model, FisherAnchor(wrong, name="m"))


def test_frozen_parameters_are_left_alone():
    model = tiny_llama()
    model.model.norm.weight.requires_grad_(False)
    state = CFPState(model, anchor_for(model))
    assert all(p is not model.model.norm.weight for p in (t.param for t in state.tensors))
