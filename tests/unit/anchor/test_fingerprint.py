"""Binding an anchor to its base model: the fingerprint and what a mismatch says."""

import json
import logging

import pytest
import torch
from support.tiny import tiny_llama

from hf_cfp.anchor.fingerprint import check_fingerprint, model_fingerprint
from hf_cfp.errors import AnchorMismatchError


class Wrapper(torch.nn.Module):
    """Adds a `module.` prefix to every name, as DDP does."""

    def __init__(self, module):
        super().__init__()
        self.module = module


def test_same_model_same_fingerprint_through_wrappers():
    model = tiny_llama(seed=0)
    fingerprint = model_fingerprint(model)
    assert fingerprint == model_fingerprint(tiny_llama(seed=0))
    assert fingerprint == model_fingerprint(Wrapper(model))
    assert fingerprint == model_fingerprint(torch.compile(model))
    assert fingerprint == model_fingerprint(Wrapper(torch.compile(model)))
    assert json.loads(json.dumps(fingerprint)) == fingerprint
    assert fingerprint["num_parameters"] == sum(p.numel() for p in model.parameters())
    names = sorted(name for name, _ in model.named_parameters())
    assert fingerprint["sampled_parameters"] == [names[0], names[len(names) // 2], names[-1]]
    assert set(fingerprint["sampled_sha256"]) == set(fingerprint["sampled_parameters"])
    check_fingerprint(fingerprint, Wrapper(torch.compile(model)), "math")


def test_frozen_parameters_count_and_tied_aliases_count_once():
    model = tiny_llama(tie=True)
    for param in model.parameters():
        param.requires_grad_(False)
    fingerprint = model_fingerprint(model)
    assert fingerprint["num_parameters"] == sum(p.numel() for p in model.parameters())
    assert "lm_head.weight" not in fingerprint["parameters"]


def test_other_weights_name_a_sampled_tensor():
    expected = model_fingerprint(tiny_llama(seed=0))
    with pytest.raises(AnchorMismatchError) as info:
        check_fingerprint(expected, tiny_llama(seed=1), "math")
    message = str(info.value)
    assert "'math'" in message and "different weights" in message
    assert any(repr(name) in message for name in expected["sampled_parameters"])
    assert "re-estimate" in message and "strict=False" in message


def test_one_changed_byte_in_a_sampled_tensor_is_found():
    model = tiny_llama(seed=0)
    expected = model_fingerprint(model)
    name = expected["sampled_parameters"][-1]
    with torch.no_grad():
        dict(model.named_parameters())[name].view(-1)[0] += 1
    with pytest.raises(AnchorMismatchError, match=f"sampled tensor {name!r} differs"):
        check_fingerprint(expected, model, "math")


def test_more_layers_names_missing_parameters():
    expected = model_fingerprint(tiny_llama(layers=3))
    with pytest.raises(AnchorMismatchError) as info:
        check_fingerprint(expected, tiny_llama(layers=2), "code")
    message = str(info.value)
    assert "parameter count" in message and str(expected["num_parameters"]) in message
    assert "missing here" in message and "'model.layers.2." in message
    with pytest.raises(AnchorMismatchError, match="not in the anchor's base model: 'model.layers.2."):
        check_fingerprint(model_fingerprint(tiny_llama(layers=2)), tiny_llama(layers=3), "code")


def test_other_shapes_are_reported():
    expected = model_fingerprint(tiny_llama(hidden_size=16))
    with pytest.raises(
        AnchorMismatchError, match=r"'model.embed_tokens.weight' is float32\[32,16\] .* float32\[32,32\]"
    ):
        check_fingerprint(expected, tiny_llama(hidden_size=32), "math")


def test_dtype_change_is_reported():
    expected = model_fingerprint(tiny_llama())
    with pytest.raises(AnchorMismatchError, match=r"is float32\[.*\] in the anchor's base model but bfloat16\["):
        check_fingerprint(expected, tiny_llama().to(torch.bfloat16), "math")


def test_without_listing_the_hash_still_catches_structure():
    expected = model_fingerprint(tiny_llama(hidden_size=16))
    expected["parameters"] = None  # as for models over MAX_LISTED parameters
    with pytest.raises(AnchorMismatchError, match="names, shapes or dtypes differ"):
        check_fingerprint(expected, tiny_llama().to(torch.bfloat16), "math")


def test_strict_false_warns_instead_once_per_process(caplog):
    """The same mismatch checked twice (two callbacks, two train() calls) warns once: `warning_once`. Under 2
    processes only the main one warns (tests/integration/test_accelerate_launch.py)."""
    expected = model_fingerprint(tiny_llama(seed=0))
    with caplog.at_level(logging.WARNING, logger="hf_cfp.anchor.fingerprint"):
        check_fingerprint(expected, tiny_llama(seed=1), "math", strict=False)
        check_fingerprint(expected, tiny_llama(seed=1), "math", strict=False)
    assert len(caplog.records) == 1 and "different weights" in caplog.records[0].getMessage()
    check_fingerprint(expected, tiny_llama(seed=1), "code", strict=False)  # another anchor: another message
    assert len(caplog.records) == 2 and "'code'" in caplog.records[1].getMessage()


@pytest.mark.parametrize("expected", [None, {}])
def test_no_fingerprint_passes(expected, caplog):
    with caplog.at_level(logging.WARNING):
        check_fingerprint(expected, tiny_llama(), "math")
    assert not caplog.records


def test_large_tensors_hash_only_their_first_mebibyte():
    model = torch.nn.Linear(1024, 512, bias=False)  # 2 MiB of float32
    expected = model_fingerprint(model)
    with torch.no_grad():
        model.weight.view(-1)[-1] += 1  # beyond the first MiB: not seen
    check_fingerprint(expected, model, "big")
    with torch.no_grad():
        model.weight.view(-1)[0] += 1
    with pytest.raises(AnchorMismatchError, match="'weight' differs"):
        check_fingerprint(expected, model, "big")


def test_all_differing_sampled_tensors_are_named_in_one_phrase():
    base, other = tiny_llama(seed=0), tiny_llama(seed=1)  # other random weights; norms are ones in both
    expected = model_fingerprint(base)
    with pytest.raises(AnchorMismatchError) as info:
        check_fingerprint(expected, other, "math")
    message = str(info.value)
    weights, others = dict(base.named_parameters()), dict(other.named_parameters())
    differing = [n for n in sorted(expected["sampled_parameters"]) if not torch.equal(weights[n], others[n])]
    assert len(differing) == 2
    listed = ", ".join(map(repr, differing))
    assert f"same names and shapes but different weights: sampled tensors {listed} differ" in message
    assert message.count("different weights") == 1


def test_one_missing_parameter_is_singular():
    model = tiny_llama()
    expected = model_fingerprint(model)
    del expected["parameters"]["lm_head.weight"]
    expected["num_parameters"] -= model.lm_head.weight.numel()
    with pytest.raises(
        AnchorMismatchError, match=r"1 parameter here is not in the anchor's base model: 'lm_head.weight'"
    ):
        check_fingerprint(expected, model, "math")
