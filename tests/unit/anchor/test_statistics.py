"""An anchor's statistics (`metadata["statistics"]`) against a plain computation."""

import math

import pytest
import torch
from benchkit.resident import statistics_peak_vs_anchor

from hf_cfp import FisherAnchor
from hf_cfp.anchor.statistics import concentration, fisher_statistics


def test_statistics_match_a_plain_computation():
    values = torch.arange(1, 201, dtype=torch.float32)  # 200 coordinates, top 1% = the two largest
    anchor = FisherAnchor({"a": values[:150], "b": values[150:].view(5, 10)}, name="s")
    stats = anchor.metadata["statistics"]
    total = sum(range(1, 201))
    assert stats["num_parameters"] == 200
    assert math.isclose(stats["total_mass"], total)
    assert math.isclose(stats["top1pct_mass_share"], (200 + 199) / total)


def reference_top_share(flat, fraction):
    ordered = flat.double().sort(descending=True).values
    return float(ordered[: math.ceil(fraction * flat.numel())].sum() / ordered.sum())


def test_streamed_statistics_and_concentration_equal_a_sort_of_the_concatenation_with_ties():
    generator = torch.Generator().manual_seed(0)
    levels = torch.tensor([0.0, 1e-6, 0.5, 2.0, 3.0])  # few distinct values: ties at every order statistic
    fisher = {
        "model.layers.0.mlp.up_proj.weight": levels[torch.randint(0, 5, (40, 30), generator=generator)],
        "model.layers.0.self_attn.q_proj.weight": torch.rand(1000, generator=generator) * 4,
        "lm_head.weight": torch.zeros(7, 3),
    }
    flat = torch.cat([t.reshape(-1) for t in fisher.values()])
    stats = fisher_statistics(fisher)
    assert stats["num_parameters"] == flat.numel() == 2221
    assert stats["total_mass"] == pytest.approx(float(flat.double().sum()), rel=1e-12)
    assert stats["max"] == float(flat.max())
    assert stats["p99"] == float(torch.kthvalue(flat, math.ceil(0.99 * 2221)).values)
    assert stats["top1pct_mass_share"] == pytest.approx(reference_top_share(flat, 0.01), rel=1e-12)
    shares = concentration(fisher)
    for label, fraction in (("0.1%", 0.001), ("1%", 0.01), ("5%", 0.05)):
        assert shares["top_shares"][label] == pytest.approx(reference_top_share(flat, fraction), rel=1e-12)
    by_type = {row["type"]: row for row in shares["module_types"]}
    assert by_type["up_proj"]["share"] == pytest.approx(
        float(fisher["model.layers.0.mlp.up_proj.weight"].double().sum() / flat.double().sum()), rel=1e-12
    )
    assert by_type["lm_head"]["count"] == 21 and by_type["lm_head"]["share"] == 0.0


def test_the_statistics_peak_stays_within_half_the_anchor_size():
    # 64 MB of F in four tensors; concatenating it (float32 + float64 copies) peaked at 7.1x the anchor
    generator = torch.Generator().manual_seed(1)
    fisher = {f"t{i}": torch.rand(size, generator=generator) for i, size in enumerate((2**21, 2**22, 2**21, 2**23))}
    assert statistics_peak_vs_anchor(fisher) <= 1.5
