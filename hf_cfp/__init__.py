"""hf-cfp: Cumulative Fisher Protection for Hugging Face Trainer and TRL."""

__version__ = "0.1.0"

from .anchor import FisherAnchor
from .callback import CFPCallback
from .errors import (
    AnchorFormatError,
    AnchorMismatchError,
    AnchorNotFoundError,
    AnchorValidationError,
    CFPArgumentError,
    CFPError,
)
from .fisher import estimate_fisher

__all__ = [
    "CFPCallback",
    "FisherAnchor",
    "estimate_fisher",
    "CFPError",
    "CFPArgumentError",
    "AnchorValidationError",
    "AnchorMismatchError",
    "AnchorFormatError",
    "AnchorNotFoundError",
]
