"""The correction group of a protecting anchor's LoRA-adapted weights (see `geometry.diagonal.lora`).

After each optimizer step every adapted weight whose F is nonzero somewhere gets new factors from the chosen
rule, applied to the summed pull P = sum_k lam_k F_k of the protecting anchors (one anchor: P = lam F); a weight
whose F is 0 everywhere is not touched (its target is the optimizer's proposal). On request the step also
measures how much of the CFP target the adapters missed:

    adapter_residual = ||D_after - D'|| / ||D'||      over the corrected weights, D' = D / (1 + P)

A weight whose protecting anchor is Kronecker-factored (one protecting anchor then covers it) is corrected by the
rule's K-FAC form (`geometry.kronecker.lora`) toward D' = the K-FAC proximal map of D; `factor_space` has none.
"""

import math

import torch

from ..errors import CFPArgumentError, CFPError
from ..geometry.diagonal.lora import LORA_RULES, cfp_target
from ..geometry.kronecker.basis import KroneckerBasis
from ..geometry.kronecker.lora import KFAC_LORA_RULES, kfac_target
from ..geometry.lora import LoraFactors
from ..ops import pull_strength
from .peft_adapters import AdaptedWeight


class AdapterCorrection:
    """The protecting anchors' LoRA-adapted weights with each anchor's F in factor orientation (out x in, None
    where that anchor does not cover the weight), and the rule."""

    def __init__(
        self,
        weights: list[AdaptedWeight],
        fishers: list[list[torch.Tensor | None]],
        rule: str,
        factored: list[tuple[AdaptedWeight, int, KroneckerBasis]] | None = None,
    ):
        if rule not in LORA_RULES:
            raise CFPArgumentError(f"lora_rule must be one of {sorted(LORA_RULES)}, got {rule!r}.")
        if factored and rule not in KFAC_LORA_RULES:
            raise CFPArgumentError(
                f"lora_rule={rule!r} has no form for a Kronecker-factored anchor; "
                f"use one of {sorted(KFAC_LORA_RULES)}."
            )
        self.rule, self.kfac_rule = LORA_RULES[rule], KFAC_LORA_RULES.get(rule)
        self.weights = [
            (weight, [weight.in_factor_orientation(f) if f is not None else None for f in row])
            for weight, row in zip(weights, fishers, strict=True)
            if any(f is not None and f.any() for f in row)
        ]
        self.factored = factored or []  # (weight, its protecting anchor's index, the base weight's basis)
        self.residual: float | None = None  # of the last measured step

    def factor_params(self) -> list[torch.Tensor]:
        """The LoRA factors (A and B of each active adapter) of the weights this correction rewrites."""
        every = [weight for weight, _ in self.weights] + [weight for weight, _, _ in self.factored]
        return [
            factors[a].weight  # type: ignore[misc]
            for weight in every
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
            current = _one_adapter(weight)
            delta = current.displacement()
            weight.write(*self.rule(current, strength, 1.0, delta))
            if measure:
                missed, target = _missed(weight, cfp_target(delta, strength, 1.0))
                missed_sq, target_sq = missed_sq + missed, target_sq + target
        for weight, k, basis in self.factored:
            current = _one_adapter(weight)
            delta = current.displacement()
            assert self.kfac_rule is not None  # checked at construction
            weight.write(*self.kfac_rule(current, basis, lams[k], delta))
            if measure:
                missed, target = _missed(weight, kfac_target(delta, basis, lams[k]))
                missed_sq, target_sq = missed_sq + missed, target_sq + target
        if measure and (self.weights or self.factored):  # no corrected adapted weight: no residual to report
            self.residual = math.sqrt(missed_sq / target_sq) if target_sq > 0 else 0.0


def _one_adapter(weight: AdaptedWeight) -> LoraFactors:
    """The one active adapter's factors of `weight` (CFPError with several)."""
    factors = weight.factors()
    if len(factors) != 1:
        raise CFPError(
            f"CFP corrects one LoRA adapter per weight; {weight.name!r} has the active adapters "
            f"{list(weight.adapters)}. Train one adapter at a time (set_adapter), or use lam=0 to measure."
        )
    return factors[0]


def _missed(weight: AdaptedWeight, target: torch.Tensor) -> tuple[float, float]:
    """(||D_after - D'||^2, ||D'||^2) of one weight, D_after as written (rounded to the factors' dtype)."""
    after = weight.factors()[0].displacement()
    return float((after - target).double().square().sum()), float(target.double().square().sum())
