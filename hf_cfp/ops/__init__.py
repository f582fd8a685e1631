"""The pure tensor math of CFP: the correction, the KL budget's lams and the drift metrics.

Imports torch (and `errors`) only, so every other layer (parallel layouts, protection, evidence) can build on it.
"""

from .budget import budget_terms, solve_budget
from .correction import AnchorFishers, PullWeights, apply_correction, pull_strength
from .drift import free_drift_sq, free_threshold, sensitive_drift_sq, total_drift_sq

__all__ = [
    "AnchorFishers",
    "PullWeights",
    "apply_correction",
    "free_drift_sq",
    "free_threshold",
    "budget_terms",
    "pull_strength",
    "solve_budget",
    "sensitive_drift_sq",
    "total_drift_sq",
]
