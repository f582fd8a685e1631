"""The correction's tensor math (`PullWeights`, `apply_correction`) against its closed form."""

import math

import torch

from hf_cfp.ops import PullWeights, apply_correction


def test_pull_weights_closed_form():
    fisher = [torch.tensor([0.0, 0.5, 2.0, 1e6])]
    (w,) = PullWeights([fisher]).at([4.0])
    expected = torch.tensor([0.0, 2.0 / 3.0, 8.0 / 9.0, 4e6 / (1 + 4e6)])
    assert torch.allclose(w, expected, rtol=1e-6)
    p, t0 = torch.tensor([1.0, 1.0, 1.0, 1.0]), torch.zeros(4)
    apply_correction([p], [t0], [w])
    # lerp computes 1 - w in float32: the error is absolute, about one float32 ulp of the step.
    assert torch.allclose(p, 1 / (1 + 4.0 * fisher[0]), rtol=1e-6, atol=2e-7)
    assert math.isclose(p[0].item(), 1.0)
