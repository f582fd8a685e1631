"""Canonical parameter names: wrapper prefixes (DDP, torch.compile, FSDP) are removed, in anchors too."""

import torch

from hf_cfp import FisherAnchor
from hf_cfp.names import canonical_name


def test_wrapper_prefixes_are_removed():
    assert canonical_name("module._orig_mod.model.layers.0.mlp.weight") == "model.layers.0.mlp.weight"
    assert canonical_name("_fsdp_wrapped_module.lm_head.weight") == "lm_head.weight"
    anchor = FisherAnchor({"module.lm_head.weight": torch.ones(2)}, name="p")
    assert list(anchor.fisher) == ["lm_head.weight"]
