"""Evidence: the experiment that compares CFP with its controls on held-out capabilities
(scripts/reproduce_table.py, scripts/budget_table.py). Not part of the `hf_cfp` package: imported as `evidence`,
with scripts/ on sys.path (a script run as `python scripts/<name>.py` has it; so do the tests, through pytest's
`pythonpath`). Needs the `trl` extra (TRL's DPO trainer, datasets)."""

from .controls import (
    KLPenaltySFTTrainer,
    StepOnlyCallback,
    isotropic_anchor,
    share_truncated_anchor,
    truncated_anchor,
)

__all__ = [
    "KLPenaltySFTTrainer",
    "StepOnlyCallback",
    "isotropic_anchor",
    "share_truncated_anchor",
    "truncated_anchor",
]
