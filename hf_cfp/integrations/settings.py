"""How CFP protects, validated once: the options of `CFP` (the loop API), `CFPCallback` and `CFPConfig` as
`ProtectionSettings`, and the binding of anchors to a model under them."""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..anchor import FisherAnchor
from ..errors import CFPArgumentError
from ..geometry.diagonal.lora import LORA_RULES
from ..protection import CFPState, MemoryPlan
from .kl_control import KLMeasurement
from .options import ProtectionOptions
from .recheck import AnchorRecheck
from .strength import Strength


@dataclass(frozen=True)
class ProtectionSettings:
    """The monitor anchors, the strength (lam_t per protecting anchor), the memory plan, the free-drift share, the
    LoRA rule, the recheck (when to re-estimate the anchors: `CFPCallback`'s; never for `CFP`) and where a
    `kl_budget` is measured of one protected run: its options, validated."""

    monitors: tuple[FisherAnchor, ...]
    strength: Strength
    memory: MemoryPlan
    free_fraction: float
    lora_rule: str
    recheck: AnchorRecheck
    kl_measurement: KLMeasurement | None

    @classmethod
    def of(
        cls,
        options: ProtectionOptions,
        anchor_names: Sequence[str],
        monitors: Sequence[FisherAnchor],
        prefix: str = "",
    ) -> "ProtectionSettings":
        """Validate `options` for protecting anchors named `anchor_names` and the (loaded) `monitors`; each message
        names an option as `prefix` + its name: `""` for `CFP` and `CFPCallback`, `"cfp_"` for `CFPConfig`'s keys
        (which pass the anchors' references as their names, before they load).

        Raises:
            CFPArgumentError: no protecting anchor, names not unique, compute_if_missing with several anchors or
                push_if_computed without it, sparse with predicted_kl_budget, free_fraction outside (0, 1), an
                unknown lora_rule, or a bad lam / kl_budget / kl_prompts / kl_every / predicted_kl_budget / memory
                plan / recheck.
        """
        _check_anchors(options, anchor_names, [m.name for m in monitors], prefix)
        strength = Strength.from_arguments(
            lam=options.lam,
            kl_budget=options.kl_budget,
            predicted_kl_budget=options.predicted_kl_budget,
            scale_with_lr=options.scale_lam_with_lr,
            num_anchors=len(anchor_names),
            prefix=prefix,
        )
        memory = MemoryPlan(
            fisher_dtype=options.fisher_dtype, sparse=options.sparse, sparse_by=options.sparse_by, prefix=prefix
        )
        if memory.sparse is not None and options.predicted_kl_budget is not None:
            raise CFPArgumentError(
                f"{prefix}predicted_kl_budget sums over every protected coordinate: use it without {prefix}sparse."
            )
        if not 0 < options.free_fraction < 1:
            raise CFPArgumentError(
                f"{prefix}free_fraction must be in (0, 1), got {options.free_fraction!r}; the paper uses 0.99."
            )
        if options.lora_rule not in LORA_RULES:
            raise CFPArgumentError(
                f"{prefix}lora_rule must be one of {sorted(LORA_RULES)}, got {options.lora_rule!r}."
            )
        recheck = AnchorRecheck(
            every=options.recheck_every,
            prompts=options.recheck_prompts,
            refresh=options.refresh_fisher,
            anchor_names=list(anchor_names),
            prefix=prefix,
        )
        kl_measurement = KLMeasurement.of(
            budget=options.kl_budget,
            prompts=options.kl_prompts,
            every=options.kl_every,
            rule=options.kl_control,
            anchor_names=anchor_names,
            prefix=prefix,
        )
        return cls(
            monitors=tuple(monitors),
            strength=strength,
            memory=memory,
            free_fraction=options.free_fraction,
            lora_rule=options.lora_rule,
            recheck=recheck,
            kl_measurement=kl_measurement,
        )

    def bind(
        self,
        model: torch.nn.Module,
        anchors: Sequence[FisherAnchor],
        optimizer: torch.optim.Optimizer | None,
        theta0: Any = None,
    ) -> CFPState:
        """A `CFPState` of `anchors` (protecting) and the monitors on `model`, theta0 from `theta0` (a
        `Theta0Reader`) or the weights now.

        Raises:
            CFPArgumentError: a predicted_kl_budget on a model with LoRA-adapted weights, or with several
                protecting anchors on a K-FAC weight (`geometry.kronecker.summed`).
        """
        protection = CFPState(
            model, anchors, self.monitors, self.free_fraction, optimizer, theta0, self.lora_rule, self.memory
        )
        if self.strength.predicted_kl_budget is not None and protection.adapters.weights:
            raise CFPArgumentError(
                "predicted_kl_budget does not cover LoRA-adapted weights: the adapter represents the CFP target only "
                "in part, so the budget could not be held. Use lam or kl_budget on a PeftModel (or full-parameter "
                "training)."
            )
        if self.strength.predicted_kl_budget is not None and protection.summed:
            protection.summed.budget_terms(self.strength.predicted_kl_budget)  # raises: says what to do
        return protection


def _check_anchors(
    options: ProtectionOptions, anchor_names: Sequence[str], monitor_names: Sequence[str], prefix: str
) -> None:
    """At least one protecting anchor, unique names, and compute_if_missing (with push_if_computed) for one."""
    if not anchor_names:
        raise CFPArgumentError(
            f"{prefix}anchor is required: the protecting anchor(s), each a FisherAnchor, a directory saved by "
            "FisherAnchor.save_pretrained (e.g. `hf-cfp estimate --output anchors/math`, then ./anchors/math) "
            "or a Hub reference org/model[@revision][:subfolder]."
        )
    names = [*anchor_names, *monitor_names]
    if len(set(names)) != len(names):
        raise CFPArgumentError(f"Anchor names must be unique (they key the metrics), got {names}.")
    if options.compute_if_missing is not None and len(anchor_names) > 1:
        raise CFPArgumentError(
            f"{prefix}compute_if_missing estimates one anchor; pass a single protecting anchor with it."
        )
    if options.push_if_computed and options.compute_if_missing is None:
        raise CFPArgumentError(
            f"{prefix}push_if_computed needs {prefix}compute_if_missing (the prompts to estimate from)."
        )
