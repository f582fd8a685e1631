"""hf-cfp: Cumulative Fisher Protection for Hugging Face Trainer and TRL.

Layers, each importing only those below it:
`errors`, `names`, `ops` (pure tensor math) < `parallel` < `anchor` < `fisher` < `protection`
< `integrations` < `demo` < `cli`.
"""

from .anchor import FisherAnchor
from .errors import (
    AnchorFormatError,
    AnchorMismatchError,
    AnchorNotFoundError,
    AnchorValidationError,
    CFPArgumentError,
    CFPError,
    CFPHubError,
)
from .fisher import estimate_fisher
from .integrations import CFPCallback
from .protection import CFPState
from .version import __version__

__all__ = [
    "AnchorFormatError",
    "AnchorMismatchError",
    "AnchorNotFoundError",
    "AnchorValidationError",
    "CFPArgumentError",
    "CFPCallback",
    "CFPError",
    "CFPHubError",
    "CFPState",
    "FisherAnchor",
    "__version__",
    "estimate_fisher",
]
