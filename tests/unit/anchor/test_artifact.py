"""FisherAnchor: exact round trip, and every bad anchor or argument refused by name.

Security (issue 6): a saved or pushed anchor is safetensors + JSON only (and the README), and an
oversized config is refused before it is parsed.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from support.tiny import anchor_for, tiny_llama

from hf_cfp import FisherAnchor
from hf_cfp.anchor.config import MAX_CONFIG_BYTES
from hf_cfp.errors import AnchorFormatError, AnchorNotFoundError, AnchorValidationError


def test_round_trip_is_exact(tmp_path):
    anchor = anchor_for(tiny_llama())
    anchor.save_pretrained(tmp_path / "math")
    loaded = FisherAnchor.from_pretrained(tmp_path / "math")
    assert loaded.name == "math"
    assert loaded.fisher.keys() == anchor.fisher.keys()
    assert all(torch.equal(loaded.fisher[n], anchor.fisher[n]) for n in anchor.fisher)
    assert loaded.metadata == json.loads(json.dumps(anchor.metadata))
    assert sorted(p.name for p in (tmp_path / "math").iterdir()) == ["cfp_config.json", "fisher.safetensors"]


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
    [
        ("{not json", "not valid JSON"),
        ('{"format_version": 1}', "lacks 'name'"),
        ('{"format_version": 99, "name": "m"}', "format_version 99"),
    ],
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


# ---------------------------------------------------------------- security: safetensors + JSON only


@pytest.mark.parametrize("max_shard_size", ["5GB", 2000])
def test_saved_anchor_is_only_safetensors_and_json(tmp_path, max_shard_size):
    anchor_for(tiny_llama()).save_pretrained(tmp_path, max_shard_size=max_shard_size)
    files = sorted(p.name for p in tmp_path.rglob("*") if p.is_file())
    assert files and all(name.endswith((".safetensors", ".json")) for name in files), files
    assert any(name.endswith(".safetensors") for name in files)
    _assert_safetensors_and_json(tmp_path, files)


def _assert_safetensors_and_json(directory, files):
    from safetensors import safe_open

    for name in files:
        if name.endswith(".json"):
            json.loads((directory / name).read_text())
        elif name.endswith(".safetensors"):
            with safe_open(directory / name, framework="pt") as handle:
                assert list(handle.keys())


def test_pushed_folder_is_only_safetensors_json_and_the_readme(tmp_path, monkeypatch):
    import hf_cfp.anchor.artifact

    seen = {}

    def fake_push(folder, repo_id, path_in_repo, **kwargs):
        seen["files"] = sorted(p.name for p in Path(folder).rglob("*") if p.is_file())
        _assert_safetensors_and_json(Path(folder), seen["files"])
        seen["readme"] = (Path(folder) / "README.md").read_text()
        return "pushed"

    monkeypatch.setattr(hf_cfp.anchor.artifact, "push_folder", fake_push)
    assert anchor_for(tiny_llama()).push_to_hub("org/anchors", max_shard_size=2000) == "pushed"
    assert "README.md" in seen["files"]
    assert all(n.endswith((".safetensors", ".json")) for n in seen["files"] if n != "README.md"), seen["files"]
    assert sum(n.endswith(".safetensors") for n in seen["files"]) > 1  # sharded


def test_oversized_config_is_refused_before_it_is_parsed(tmp_path):
    anchor_for(tiny_llama()).save_pretrained(tmp_path)
    config_path = tmp_path / "cfp_config.json"
    config = json.loads(config_path.read_text())
    config["padding"] = "x" * MAX_CONFIG_BYTES  # valid JSON, valid fields, just too large
    config_path.write_text(json.dumps(config))
    assert config_path.stat().st_size > 2**20 >= MAX_CONFIG_BYTES
    with pytest.raises(AnchorFormatError, match="over .* bytes"):
        FisherAnchor.from_pretrained(tmp_path)
