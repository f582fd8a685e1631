"""An anchor's statistics (`metadata["statistics"]`) against a plain computation."""

import math

import torch

from hf_cfp import FisherAnchor


def test_statistics_match_a_plain_computation():
    values = torch.arange(1, 201, dtype=torch.float32)  # 200 coordinates, top 1% = the two largest
    anchor = FisherAnchor({"a": values[:150], "b": values[150:].view(5, 10)}, name="s")
    stats = anchor.metadata["statistics"]
    total = sum(range(1, 201))
    assert stats["num_parameters"] == 200
    assert math.isclose(stats["total_mass"], total)
    assert math.isclose(stats["top1pct_mass_share"], (200 + 199) / total)
