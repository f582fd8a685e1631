"""The pure tensor math of CFP: the correction, the KL budget's lams and the drift metrics.

Imports torch (and `errors`) only, so every other layer (parallel layouts, protection, evidence) can build on it.
"""

from .budget import budget_terms, solve_budget
from .chunks import chunk_elements, flat, spans
from .correction import AnchorFishers, PullStrengths, proximal_pull_, pull_strength
from .drift import DriftView, drift_squares, free_threshold

__all__ = [
    "AnchorFishers",
    "DriftView",
    "PullStrengths",
    "budget_terms",
    "chunk_elements",
    "drift_squares",
    "flat",
    "free_threshold",
    "proximal_pull_",
    "pull_strength",
    "solve_budget",
    "spans",
]
