"""The correction group of a protecting anchor's LoRA-adapted weights (see `ops.lora_correction`).

After each optimizer step every adapted weight whose F is nonzero somewhere gets new factors from the chosen
rule; a weight whose F is 0 everywhere is not touched (its target is the optimizer's proposal). On request the
step also measures how much of the CFP target the adapters missed:

    adapter_residual = ||D_after - D'|| / ||D'||      over the corrected weights, D' = D / (1 + lam F)
"""

import math

import torch

from ..errors import CFPArgumentError, CFPError
from ..ops.lora_correction import LORA_RULES, cfp_target
from .peft_adapters import AdaptedWeight


class AdapterCorrection:
    """The protecting anchor's LoRA-adapted weights with F in factor orientation (out x in), and the rule."""

    def __init__(self, weights: list[AdaptedWeight], fisher: list[torch.Tensor], rule: str):
        if rule not in LORA_RULES:
            raise CFPArgumentError(f"lora_rule must be one of {sorted(LORA_RULES)}, got {rule!r}.")
        self.rule = LORA_RULES[rule]
        self.weights = [
            (weight, weight.in_factor_orientation(f)) for weight, f in zip(weights, fisher, strict=True) if f.any()
        ]
        self.residual: float | None = None  # of the last measured step

    @torch.no_grad()
    def correct(self, lam: float, measure: bool = False) -> None:
        """Replace each weight's factors by the rule's (B', A'); with `measure`, set `residual`."""
        missed_sq, target_sq = 0.0, 0.0
        for weight, fisher in self.weights:
            factors = weight.factors()
            if len(factors) != 1:
                raise CFPError(
                    f"CFP corrects one LoRA adapter per weight; {weight.name!r} has the active adapters "
                    f"{list(weight.adapters)}. Train one adapter at a time (set_adapter), or use lam=0 to measure."
                )
            (current,) = factors
            delta = current.displacement()
            b, a = self.rule(current, fisher, lam, delta)
            weight.write(b, a)
            if measure:
                target = cfp_target(delta, fisher, lam)
                after = weight.factors()[0].displacement()  # as written (rounded to the factors' dtype)
                missed_sq += float((after - target).double().square().sum())
                target_sq += float(target.double().square().sum())
        if measure and self.weights:  # no corrected adapted weight (a full model): no residual to report
            self.residual = math.sqrt(missed_sq / target_sq) if target_sq > 0 else 0.0
