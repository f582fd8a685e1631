"""The pure tensor math of CFP: the correction and the drift metrics.

Imports torch only, so every other layer (parallel layouts, protection, evidence) can build on it.
"""

from .correction import PullWeights, apply_correction, lerp_weights
from .drift import free_drift_sq, free_threshold, sensitive_drift_sq, total_drift_sq

__all__ = [
    "PullWeights",
    "apply_correction",
    "free_drift_sq",
    "free_threshold",
    "lerp_weights",
    "sensitive_drift_sq",
    "total_drift_sq",
]
