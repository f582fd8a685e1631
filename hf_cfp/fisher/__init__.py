"""Fisher estimation: prompts -> on-policy sampling -> per-sequence squared scores -> FisherAnchor."""

from .estimate import estimate_fisher
from .sampling import Sampler

__all__ = ["estimate_fisher", "Sampler"]
