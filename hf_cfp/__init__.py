"""hf-cfp: Cumulative Fisher Protection for Hugging Face Trainer and TRL.

Layers, each importing only those below it:
`errors`, `names`, `ops` (pure tensor math) < `parallel` < `anchor` < `fisher` < `protection`
< `evaluation` < `integrations` < `demo` < `evidence` < `launch` < `cli`.
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
from .evaluation import KLEstimate, kl_to_base, kl_to_base_with_stderr
from .fisher import estimate_fisher
from .integrations import CFP, CFPCallback, KLToBaseCallback
from .launch import CFPConfig
from .protection import CFPState
from .version import __version__

__all__ = [
    "AnchorFormatError",
    "AnchorMismatchError",
    "AnchorNotFoundError",
    "AnchorValidationError",
    "CFP",
    "CFPArgumentError",
    "CFPCallback",
    "CFPConfig",
    "CFPError",
    "CFPHubError",
    "CFPState",
    "FisherAnchor",
    "KLEstimate",
    "KLToBaseCallback",
    "__version__",
    "estimate_fisher",
    "kl_to_base",
    "kl_to_base_with_stderr",
]
