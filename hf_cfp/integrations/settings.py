"""How CFP protects, validated once: the settings `CFP` (the loop API) and `CFPCallback` share, and the binding of
anchors to a model under them."""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..anchor import FisherAnchor
from ..errors import CFPArgumentError
from ..ops.lora_correction import LORA_RULES
from ..protection import CFPState, MemoryPlan
from .strength import Strength


@dataclass(frozen=True)
class ProtectionSettings:
    """The monitor anchors, the strength (lam_t per protecting anchor), the memory plan, the free-drift share and
    the LoRA rule of one protected run."""

    monitors: tuple[FisherAnchor, ...]
    strength: Strength
    memory: MemoryPlan
    free_fraction: float
    lora_rule: str

    @classmethod
    def from_arguments(
        cls,
        anchor_names: Sequence[str],
        monitors: Sequence[FisherAnchor],
        lam: Any,
        kl_budget: Any,
        scale_lam_with_lr: bool,
        free_fraction: float,
        lora_rule: str,
        fisher_dtype: str,
        sparse: float | None,
        sparse_by: str,
    ) -> "ProtectionSettings":
        """Validate the user's arguments (as `CFP` and `CFPCallback` take them) for protecting anchors named
        `anchor_names`.

        Raises:
            CFPArgumentError: no protecting anchor, names not unique, free_fraction outside (0, 1), an unknown
                lora_rule, sparse with kl_budget, or a bad lam / kl_budget / memory plan.
        """
        if not anchor_names:
            raise CFPArgumentError("CFP needs at least one protecting anchor.")
        names = [*anchor_names, *(m.name for m in monitors)]
        if len(set(names)) != len(names):
            raise CFPArgumentError(f"Anchor names must be unique (they key the metrics), got {names}.")
        strength = Strength.from_arguments(lam, kl_budget, scale_lam_with_lr, len(anchor_names))
        memory = MemoryPlan(fisher_dtype, sparse, sparse_by)
        if memory.sparse is not None and kl_budget is not None:
            raise CFPArgumentError("kl_budget sums over every protected coordinate: use it without sparse.")
        if not 0 < free_fraction < 1:
            raise CFPArgumentError(f"free_fraction must be in (0, 1), got {free_fraction!r}; the paper uses 0.99.")
        if lora_rule not in LORA_RULES:
            raise CFPArgumentError(f"lora_rule must be one of {sorted(LORA_RULES)}, got {lora_rule!r}.")
        return cls(tuple(monitors), strength, memory, free_fraction, lora_rule)

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
            CFPArgumentError: a kl_budget on a model with LoRA-adapted weights.
        """
        protection = CFPState(
            model, anchors, self.monitors, self.free_fraction, optimizer, theta0, self.lora_rule, self.memory
        )
        if self.strength.kl_budget is not None and protection.adapters.weights:
            raise CFPArgumentError(
                "kl_budget does not cover LoRA-adapted weights: the adapter represents the CFP target only in "
                "part, so the budget could not be held. Use lam on a PeftModel (or full-parameter training)."
            )
        return protection
