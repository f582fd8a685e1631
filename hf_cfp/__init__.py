"""hf-cfp: Cumulative Fisher Protection for Hugging Face Trainer and TRL.

Layers, each importing only those below it:
`errors`, `imports` (optional packages probed), `names`, `ops` (pure tensor math) < `parallel` < `anchor`
< `fisher` < `protection` < `evaluation` < `loading` (models and prompt sets the CLI, launcher and demo load)
< `integrations` < `demo` < `launch` < `cli`. The experiment harness and benchmark instrumentation live outside
the package, in scripts/ (`evidence`, `benchkit`).

Importing the package changes nothing outside it: no logger, warning filter or model is touched.

The public names below torch (`FisherAnchor`, `CFPCallback`, ...) are imported on first use (module
`__getattr__`, PEP 562), so that `import hf_cfp.cli` and `hf-cfp --help` do not load torch; `from hf_cfp import X`
works as for any attribute.
"""

from typing import TYPE_CHECKING

from .errors import (
    AnchorFormatError,
    AnchorMismatchError,
    AnchorNotFoundError,
    AnchorValidationError,
    CFPArgumentError,
    CFPError,
    CFPHubError,
)
from .exports import lazy_exports
from .version import __version__

if TYPE_CHECKING:  # what the lazy names below resolve to, for type checkers
    from .anchor import FisherAnchor
    from .evaluation import KLEstimate, kl_to_base, kl_to_base_with_stderr
    from .fisher import estimate_fisher
    from .integrations import CFP, CFPCallback, KLToBaseCallback
    from .launch import CFPConfig
    from .loading import load_embedded_model
    from .protection import CFPState

# public name -> the subpackage that defines it, imported when the name is first read
_LAZY_EXPORTS = {
    "FisherAnchor": "anchor",
    "KLEstimate": "evaluation",
    "kl_to_base": "evaluation",
    "kl_to_base_with_stderr": "evaluation",
    "estimate_fisher": "fisher",
    "CFP": "integrations",
    "CFPCallback": "integrations",
    "KLToBaseCallback": "integrations",
    "CFPConfig": "launch",
    "CFPState": "protection",
    "load_embedded_model": "loading",
}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY_EXPORTS)

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
    "load_embedded_model",
]
