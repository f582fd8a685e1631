"""The diagonal geometry's estimate sink: per parameter, the sums of the squared per-sequence scores the scoring pass
adds, kept apart for the two halves of the calibration sequences (the split-half statistics)."""

from collections.abc import Sequence

import torch

from ...ops.order_statistics import float64_sum, top_overlap
from ..base import EstimatePart, EstimatePlan, LayerSums, Scored


class DiagonalSink:
    """S_a and S_b, the sums over the sequences n < half and n >= half of (d/dtheta_i log mu(y_n | x_n))^2 per
    parameter (float32, beside it), added by the scoring pass (a `base.EstimateSink`); then

        F = (S_a + S_b) / N,  and the split-half statistics of F_a = S_a / N_a and F_b = S_b / N_b
        (`split_half`; none when half = 0, and then S_a is not kept at all).
    """

    replays = False  # complete after one pass

    def __init__(self, claimed: list[Scored], plan: EstimatePlan):
        self.names = [s.name for s in claimed]
        self.params = [s.param for s in claimed]
        self.num_sequences, self.half = plan.num_sequences, plan.half
        self.second = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]  # S_b, then S = S_a + S_b
        self.first = [torch.zeros_like(s) for s in self.second] if self.half else []  # S_a: the one extra accumulator

    def squares(self, first_half: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return list(zip(self.params, self.first if first_half else self.second, strict=True))

    def layers(self) -> list[tuple[torch.Tensor, LayerSums]]:
        return []

    def positions(self, count: int) -> None:
        """Not needed: F is a mean over sequences."""

    def reduced(self) -> list[torch.Tensor]:
        return [*self.second, *self.first]

    def counts(self) -> list[torch.Tensor]:
        """No counters: the sequence counts are known to every process."""
        return []

    def refine(self) -> list[tuple[torch.Tensor, LayerSums]]:
        return []

    def refined(self) -> list[torch.Tensor]:
        return []

    def finish(self) -> EstimatePart:
        """F by name and the split-half statistics. S_a is released before F is moved to the CPU (the anchor's
        statistics need memory of their own)."""
        sums = self.second
        reliability = split_half(self.first, sums, self.half, self.num_sequences - self.half) if self.half else None
        if self.half:
            torch._foreach_add_(sums, self.first)
        self.first = []
        fisher = {n: s.div_(self.num_sequences).cpu() for n, s in zip(self.names, sums, strict=True)}
        return EstimatePart(fisher=fisher, split_half=reliability)


def split_half(first_sums: Sequence[torch.Tensor], second_sums: Sequence[torch.Tensor], n_first: int, n_second: int):
    """Split-half reliability from the squared-score sums of two halves of the sequences, F_a = S_a / N_a and
    F_b = S_b / N_b: {"top1pct_overlap": |T1(F_a) ∩ T1(F_b)| / |T1| (T1 the top 1%; a set does not change
    with the scale, so it is taken on the sums), "mass_relative_difference": |M_a - M_b| / ((M_a + M_b) / 2)
    with M = sum_i F_i (0 when both are 0), "num_sequences": [N_a, N_b]}."""
    mass_a = float64_sum(first_sums) / n_first
    mass_b = float64_sum(second_sums) / n_second
    return {
        "top1pct_overlap": top_overlap(first_sums, second_sums, 0.01),
        "mass_relative_difference": abs(mass_a - mass_b) / ((mass_a + mass_b) / 2) if mass_a + mass_b > 0 else 0.0,
        "num_sequences": [n_first, n_second],
    }
