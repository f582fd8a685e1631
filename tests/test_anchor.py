"""FisherAnchor: exact round trip, and every bad anchor or argument refused by name."""

import json
import math

import pytest
import torch
from safetensors.torch import save_file
from support.tiny import anchor_for, tiny_llama

from hf_cfp import (
    AnchorFormatError,
    AnchorMismatchError,
    AnchorNotFoundError,
    AnchorValidationError,
    CFPArgumentError,
    CFPCallback,
    FisherAnchor,
)
from hf_cfp.names import canonical_name
from hf_cfp.protection import CFPState



def test_round_trip_is_exact(tmp_path):
    anchor = anchor_for(tiny_llama())
    anchor.save_pretrained(tmp_path / "math")
    loaded = FisherAnchor.from_pretrained(tmp_path / "math")
    assert loaded.name == "math"
    assert loaded.fisher.keys() == anchor.fisher.keys()
    assert all(torch.equal(loaded.fisher[n], anchor.fisher[n]) for n in anchor.fisher)
    assert loaded.metadata == json.loads(json.dumps(anchor.metadata))
    assert sorted(p.name for p in (tmp_path / "math").iterdir()) == ["cfp_config.json", "fisher.safetensors"]


def test_statistics_match_a_plain_computation():
    values = torch.arange(1, 201, dtype=torch.float32)  # 200 coordinates, top 1% = the two largest
    anchor = FisherAnchor({"a": values[:150], "b": values[150:].view(5, 10)}, name="s")
    stats = anchor.metadata["statistics"]
    total = sum(range(1, 201))
    assert stats["num_parameters"] == 200
    assert math.isclose(stats["total_mass"], total)
    assert math.isclose(stats["top1pct_mass_share"], (200 + 199) / total)


@pytest.mark.parametrize("value, words", [(float("nan"), "NaN/Inf"), (float("inf"), "NaN/Inf"), (-1.0, "negative")])
def test_bad_values_are_refused_naming_the_parameter(value, words):
    bad = torch.rand(3, 4)
    bad[1, 2] = value
    with pytest.raises(AnchorValidationError, match=rf"'layer\.weight' has 1 {words}"):
        FisherAnchor({"layer.bias": torch.rand(4), "layer.weight": bad}, name="x")


def test_bad_values_in_a_saved_file_are_refused_on_load(tmp_path):
    anchor_for(tiny_llama()).save_pretrained(tmp_path)
    save_file({"model.norm.weight": torch.tensor([1.0, float("nan")])}, tmp_path / "fisher.safetensors")
    with pytest.raises(AnchorValidationError, match="model.norm.weight"):
        FisherAnchor.from_pretrained(tmp_path)


def test_truncated_file_is_a_format_error(tmp_path):
    anchor_for(tiny_llama()).save_pretrained(tmp_path)
    weights = tmp_path / "fisher.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(AnchorFormatError, match="truncated or corrupt"):
        FisherAnchor.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "config, message",
    [("{not json", "not valid JSON"), ('{"format_version": 1}', "lacks 'name'"),
     ('{"format_version": 99, "name": "m"}', "format_version 99")],
)
def test_bad_config_is_a_format_error(tmp_path, config, message):
    anchor_for(tiny_llama()).save_pretrained(tmp_path)
    (tmp_path / "cfp_config.json").write_text(config)
    with pytest.raises(AnchorFormatError, match=message):
        FisherAnchor.from_pretrained(tmp_path)


def test_missing_anchor_is_not_found(tmp_path):
    with pytest.raises(AnchorNotFoundError, match="No anchor directory"):
        FisherAnchor.from_pretrained(tmp_path / "nothing")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "cfp_config.json").write_text('{"format_version": 1, "name": "m"}')
    with pytest.raises(AnchorNotFoundError, match="holds no anchor tensors: neither fisher.safetensors"):
        FisherAnchor.from_pretrained(tmp_path / "half")


def test_failed_save_keeps_the_anchor_already_saved(tmp_path, monkeypatch):
    original = anchor_for(tiny_llama(), seed=0)
    original.save_pretrained(tmp_path)
    import hf_cfp.anchor.storage as storage_module

    def broken_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(storage_module, "save_file", broken_save)
    with pytest.raises(OSError, match="disk full"):
        anchor_for(tiny_llama(), seed=1).save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cfp_config.json", "fisher.safetensors"]
    reloaded = FisherAnchor.from_pretrained(tmp_path)
    assert all(torch.equal(reloaded.fisher[n], original.fisher[n]) for n in original.fisher)


@pytest.mark.parametrize("name", ["", "../up", "a/b", "a..b", "has space", "x" * 65])
def test_unsafe_names_are_refused(name):
    with pytest.raises(AnchorValidationError, match="not allowed"):
        FisherAnchor({"w": torch.ones(2)}, name=name)


def test_wrapper_prefixes_are_removed():
    assert canonical_name("module._orig_mod.model.layers.0.mlp.weight") == "model.layers.0.mlp.weight"
    assert canonical_name("_fsdp_wrapped_module.lm_head.weight") == "lm_head.weight"
    anchor = FisherAnchor({"module.lm_head.weight": torch.ones(2)}, name="p")
    assert list(anchor.fisher) == ["lm_head.weight"]


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
    assert all(p is not model.model.norm.weight for p in state.params)


@pytest.mark.parametrize("lam", [-1.0, float("nan"), float("inf"), "1"])
def test_bad_lam_is_refused(lam):
    with pytest.raises(CFPArgumentError, match="lam must be"):
        CFPCallback(anchor_for(tiny_llama()), lam=lam)


def test_bad_lam_schedule_is_refused_at_its_step():
    callback = CFPCallback(anchor_for(tiny_llama()), lam=lambda step: 1.0 - step)
    assert callback.lam_at(1) == 0.0
    with pytest.raises(CFPArgumentError, match="schedule"):
        callback.lam_at(2)


@pytest.mark.parametrize("fraction", [0.0, 1.0, 1.5, -0.1])
def test_free_fraction_outside_open_unit_interval_is_refused(fraction):
    with pytest.raises(CFPArgumentError, match="free_fraction"):
        CFPCallback(anchor_for(tiny_llama()), free_fraction=fraction)


def test_duplicate_anchor_names_are_refused():
    model = tiny_llama()
    with pytest.raises(CFPArgumentError, match="unique"):
        CFPCallback(anchor_for(model, "math"), monitor=[anchor_for(model, "math", seed=2)])


def test_callback_accepts_a_directory(tmp_path):
    anchor_for(tiny_llama()).save_pretrained(tmp_path / "a")
    assert CFPCallback(str(tmp_path / "a")).anchor.name == "math"


def test_an_anchor_of_another_base_model_is_refused_at_train_begin(caplog):
    from transformers import TrainerControl, TrainerState

    from hf_cfp import estimate_fisher

    base = tiny_llama(seed=0)
    anchor = estimate_fisher(base, None, [[1, 2, 3]], num_sequences=2, max_new_tokens=2, show_progress=False, name="m")
    assert anchor.metadata["base_fingerprint"]["num_parameters"] == sum(p.numel() for p in base.parameters())
    other = tiny_llama(seed=1)  # same architecture, other weights
    with pytest.raises(AnchorMismatchError, match="another base model.*different weights"):
        CFPCallback(anchor).on_train_begin(None, TrainerState(), TrainerControl(), model=other)
    lenient = CFPCallback(anchor, strict=False)
    lenient.on_train_begin(None, TrainerState(), TrainerControl(), model=other)
    assert "another base model" in caplog.text and lenient.protection.model is other
    CFPCallback(anchor).on_train_begin(None, TrainerState(), TrainerControl(), model=base)  # the right one binds


def test_deepspeed_and_fsdp1_are_refused_with_a_clear_error(monkeypatch):
    from types import SimpleNamespace

    from transformers import TrainerControl, TrainerState

    from hf_cfp import CFPError

    model = tiny_llama()
    callback = CFPCallback(anchor_for(model))
    with pytest.raises(CFPError, match="DeepSpeed but its `optimizer` argument is not a ZeRO"):
        callback.on_train_begin(SimpleNamespace(deepspeed="ds_config.json"), TrainerState(), TrainerControl(), model=model)
    monkeypatch.setattr(model.model.norm.weight, "ds_id", 3, raising=False)  # a ZeRO-3 partitioned parameter
    with pytest.raises(CFPError, match="DeepSpeed but its `optimizer` argument is not a ZeRO"):
        callback.on_train_begin(None, TrainerState(), TrainerControl(), model=model)
    monkeypatch.delattr(model.model.norm.weight, "ds_id")
    callback.on_train_begin(None, TrainerState(), TrainerControl(), model=model)  # a plain model binds
    assert callback.protection.model is model
