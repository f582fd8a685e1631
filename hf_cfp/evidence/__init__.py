"""Evidence: the experiment that compares CFP with its controls on held-out capabilities
(scripts/reproduce_table.py)."""

from .controls import KLPenaltySFTTrainer, StepOnlyCallback, isotropic_anchor

__all__ = ["KLPenaltySFTTrainer", "StepOnlyCallback", "isotropic_anchor"]
