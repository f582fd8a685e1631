"""FisherAnchor.combine: F = sum_k w_k F_k against a plain float64 loop, its metadata, round trips through
save / load and the fake Hub (tests/support/hub_server.py), and every mismatch refused by name."""

import json

import pytest
import torch
from support.anchors import same_anchor

from hf_cfp import FisherAnchor
from hf_cfp.errors import AnchorMismatchError, AnchorValidationError, CFPArgumentError

BASE = {"base_model": "org/base", "base_model_revision": "abc123", "base_fingerprint": {"version": 1, "n": 16}}


def parts(k=3, seed=0, metadata=BASE):
    g = torch.Generator().manual_seed(seed)
    return [
        FisherAnchor(
            {"layer.weight": torch.rand(3, 4, generator=g) * 10, "layer.bias": torch.rand(4, generator=g)},
            name=f"p{i}",
            metadata={**metadata, "num_sequences": 8 * (i + 1), "seed": i},
        )
        for i in range(k)
    ]


def plain_weighted_sum(anchors, weights):
    """{name: [sum_k w_k F_k[i] for every flat index i]}, one Python float (float64) at a time."""
    return {
        key: [
            sum(w * float(a.fisher[key].reshape(-1)[i]) for a, w in zip(anchors, weights, strict=True))
            for i in range(tensor.numel())
        ]
        for key, tensor in anchors[0].fisher.items()
    }


def test_weighted_sum_matches_a_plain_float64_loop():
    anchors, weights = parts(), [0.25, 2.0, 1.5]
    combined = FisherAnchor.combine(anchors, weights=weights, name="mix")
    reference = plain_weighted_sum(anchors, weights)
    for key, values in reference.items():
        assert combined.fisher[key].dtype == torch.float32
        assert combined.fisher[key].reshape(-1).tolist() == pytest.approx(values, rel=1e-7)  # float32 rounding
    stats = combined.metadata["statistics"]  # recomputed from the combined values
    assert stats["num_parameters"] == 16
    assert stats["total_mass"] == pytest.approx(sum(sum(v) for v in reference.values()), rel=1e-6)


def test_default_weights_give_the_mean_and_a_zero_weight_drops_a_part():
    anchors = parts()
    mean = FisherAnchor.combine(anchors, name="mean")
    for key, values in plain_weighted_sum(anchors, [1.0, 1.0, 1.0]).items():
        assert mean.fisher[key].reshape(-1).tolist() == pytest.approx([v / 3 for v in values], rel=1e-7)
    assert [p["weight"] for p in mean.metadata["combined_from"]] == [1 / 3] * 3
    dropped = FisherAnchor.combine(anchors, weights=[1.0, 0.0, 0.0])
    assert same_anchor(dropped, anchors[0]) and dropped.name == "combined"


def test_metadata_keeps_the_base_model_and_lists_the_parts():
    combined = FisherAnchor.combine(parts(2), weights=[1, 3], name="mix")
    metadata = combined.metadata
    assert {k: metadata[k] for k in BASE} == BASE
    assert metadata["combined_from"] == [
        {"name": "p0", "weight": 1.0, "reference": None},
        {"name": "p1", "weight": 3.0, "reference": None},
    ]
    assert "num_sequences" not in metadata and "seed" not in metadata  # the parts' own, not the combination's


def test_round_trip_through_save_and_load(tmp_path):
    combined = FisherAnchor.combine(parts(), weights=[0.5, 0.25, 0.25], name="mix")
    combined.save_pretrained(tmp_path / "mix")
    loaded = FisherAnchor.from_pretrained(tmp_path / "mix")
    assert loaded.name == "mix" and same_anchor(loaded, combined)
    assert loaded.metadata == json.loads(json.dumps(combined.metadata))


def test_round_trip_through_the_hub_records_the_parts_references(local_hub, tmp_path):
    for part in parts(2):
        part.push_to_hub("org/anchors")
    commit = local_hub.resolve("org/anchors", "main")
    pulled = [FisherAnchor.from_pretrained(f"org/anchors:cfp/p{i}", cache_dir=tmp_path) for i in range(2)]
    combined = FisherAnchor.combine(pulled, name="mix")
    assert [p["reference"] for p in combined.metadata["combined_from"]] == [
        f"org/anchors@{commit}:cfp/p0",
        f"org/anchors@{commit}:cfp/p1",
    ]
    combined.push_to_hub("org/anchors")
    again = FisherAnchor.from_pretrained("org/anchors:cfp/mix", cache_dir=tmp_path)
    assert same_anchor(again, combined)
    assert again.metadata["combined_from"] == combined.metadata["combined_from"]
    assert again.metadata["base_fingerprint"] == BASE["base_fingerprint"]


def test_parts_over_other_tensors_are_refused_naming_the_first_difference():
    a, b = parts(2)
    other_shape = FisherAnchor({"layer.weight": torch.rand(4, 3), "layer.bias": torch.rand(4)}, "c", BASE)
    missing = FisherAnchor({"layer.weight": torch.rand(3, 4)}, "d", BASE)
    extra = FisherAnchor({**b.fisher, "head.weight": torch.rand(2)}, "e", BASE)
    with pytest.raises(AnchorMismatchError, match=r"'p0' and 'c': parameter 'layer.weight' has shape \(3, 4\)"):
        FisherAnchor.combine([a, other_shape])
    with pytest.raises(AnchorMismatchError, match="'layer.bias' is in the first but not the second"):
        FisherAnchor.combine([a, b, missing])
    with pytest.raises(AnchorMismatchError, match="'head.weight' is in the second but not the first"):
        FisherAnchor.combine([a, extra])


@pytest.mark.parametrize(
    "key, value, shown",
    [
        ("base_model", "org/other", r"\('org/base' vs 'org/other'\)"),
        ("base_model_revision", None, r"\('abc123' vs None\)"),
        ("base_fingerprint", {"version": 1, "n": 17}, "differs, so"),
    ],
)
def test_parts_of_other_base_models_are_refused(key, value, shown):
    a, b = parts(2), parts(1, metadata={**BASE, key: value})[0]
    with pytest.raises(AnchorMismatchError, match=f"anchors 'p0' and 'p0': their metadata '{key}' differs"):
        FisherAnchor.combine([*a, b])
    with pytest.raises(AnchorMismatchError, match=shown):
        FisherAnchor.combine([*a, b])


@pytest.mark.parametrize(
    "weights, message",
    [
        ([1.0], "Got 1 weight for 2 anchors"),
        ([1.0, -0.5], "finite numbers >= 0"),
        ([1.0, float("nan")], "finite numbers >= 0"),
        ([float("inf"), 1.0], "finite numbers >= 0"),
        ([0.0, 0.0], "not all 0"),
        ([True, 1.0], "finite numbers >= 0"),
    ],
)
def test_bad_weights_are_refused(weights, message):
    with pytest.raises(CFPArgumentError, match=message):
        FisherAnchor.combine(parts(2), weights=weights)


def test_no_parts_or_a_bad_name_are_refused():
    with pytest.raises(CFPArgumentError, match="non-empty list of FisherAnchor"):
        FisherAnchor.combine([])
    with pytest.raises(AnchorValidationError, match="not allowed"):
        FisherAnchor.combine(parts(2), name="../x")
