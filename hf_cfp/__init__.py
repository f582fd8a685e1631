"""hf-cfp: Cumulative Fisher Protection for Hugging Face Trainer and TRL.

Layers, each importing only those below it:
`errors`, `names`, `ops` (pure tensor math) < `parallel` < `anchor` < `fisher` < `protection`
< `evaluation` < `integrations` < `demo` < `evidence` < `cli`.
"""

from .anchor import FisherAnchor
from .demo import load_embedded_model
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
    "load_embedded_model",
]
