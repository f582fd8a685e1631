"""The correction group of a protecting anchor's LoRA-adapted weights (see `ops.lora_correction`).

After each optimizer step every adapted weight whose F is nonzero somewhere gets new factors from the chosen
rule, applied to the summed pull P = sum_k lam_k F_k of the protecting anchors (one anchor: P = lam F); a weight
whose F is 0 everywhere is not touched (its target is the optimizer's proposal). On request the step also
measures how much of the CFP target the adapters missed:

    adapter_residual = ||D_after - D'|| / ||D'||      over the corrected weights, D' = D / (1 + P)
"""

import math

import torch

from ..errors import CFPArgumentError, CFPError
from ..ops import pull_strength
from ..ops.lora_correction import LORA_RULES, cfp_target
from .peft_adapters import AdaptedWeight


class AdapterCorrection:
    """The protecting anchors' LoRA-adapted weights with each anchor's F in factor orientation (out x in, None
    where that anchor does not cover the weight), and the rule."""

    def __init__(self, weights: list[AdaptedWeight], fishers: list[list[torch.Tensor | None]], rule: str):
        if rule not in LORA_RULES:
            raise CFPArgumentError(f"lora_rule must be one of {sorted(LORA_RULES)}, got {rule!r}.")
        self.rule = LORA_RULES[rule]
        self.weights = [
            (weight, [weight.in_factor_orientation(f) if f is not None else None for f in row])
            for weight, row in zip(weights, fishers, strict=True)
            if any(f is not None and f.any() for f in row)
        ]
        self.residual: float | None = None  # of the last measured step

    def factor_params(self) -> list[torch.Tensor]:
        """The LoRA factors (A and B of each active adapter) of the weights this correction rewrites."""
        return [
            factors[a].weight  # type: ignore[misc]
            for weight, _ in self.weights
            for a in weight.adapters
            for factors in (weight.layer.lora_A, weight.layer.lora_B)
        ]

    @torch.no_grad()
    def correct(self, lams: list[float], measure: bool = False) -> None:
        """Replace each weight's factors by the rule's (B', A') for the pull P = sum_k lam_k F_k; with
        `measure`, set `residual`."""
        missed_sq, target_sq = 0.0, 0.0
        for weight, row in self.weights:
            strength = pull_strength(row, lams)
            assert strength is not None  # kept above: some anchor covers the weight
            factors = weight.factors()
            if len(factors) != 1:
                raise CFPError(
                    f"CFP corrects one LoRA adapter per weight; {weight.name!r} has the active adapters "
                    f"{list(weight.adapters)}. Train one adapter at a time (set_adapter), or use lam=0 to measure."
                )
            (current,) = factors
            delta = current.displacement()
            b, a = self.rule(current, strength, 1.0, delta)
            weight.write(b, a)
            if measure:
                target = cfp_target(delta, strength, 1.0)
                after = weight.factors()[0].displacement()  # as written (rounded to the factors' dtype)
                missed_sq += float((after - target).double().square().sum())
                target_sq += float(target.double().square().sum())
        if measure and self.weights:  # no corrected adapted weight (a full model): no residual to report
            self.residual = math.sqrt(missed_sq / target_sq) if target_sq > 0 else 0.0
