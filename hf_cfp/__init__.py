"""hf-cfp: Cumulative Fisher Protection for Hugging Face Trainer and TRL.

Layers, each importing only those below it:
`errors`, `imports` (optional packages probed), `names`, `ops` (pure tensor math) < `parallel` < `anchor`
< `fisher` < `protection` < `evaluation` < `loading` (models and prompt sets the CLI, launcher and demo load)
< `integrations` < `demo` < `launch` < `cli`. The experiment harness and benchmark instrumentation live outside
the package, in scripts/ (`evidence`, `benchkit`).

Importing the package changes nothing outside it: no logger, warning filter or model is touched.

The top level holds what a user needs: `estimate_fisher`, `FisherAnchor`, `CFPCallback`, `CFP`, `CFPError` and the
capability-KL helpers `kl_to_base` and `KLToBaseCallback`; the rest lives in its subpackage (`hf_cfp.errors` for the
error subclasses, `hf_cfp.protection.CFPState`, `hf_cfp.launch.CFPConfig`, `hf_cfp.loading.load_embedded_model`,
`hf_cfp.evaluation.kl_to_base_with_stderr`). The public names below torch are imported on first use (module
`__getattr__`, PEP 562), so that `import hf_cfp.cli` and `hf-cfp --help` do not load torch; `from hf_cfp import X`
works as for any attribute.
"""

from typing import TYPE_CHECKING

from .errors import CFPError
from .exports import lazy_exports
from .version import __version__

if TYPE_CHECKING:  # what the lazy names below resolve to, for type checkers
    from .anchor import FisherAnchor
    from .evaluation import kl_to_base
    from .fisher import estimate_fisher
    from .integrations import CFP, CFPCallback, KLToBaseCallback

# public name -> the subpackage that defines it, imported when the name is first read
_LAZY_EXPORTS = {
    "FisherAnchor": "anchor",
    "kl_to_base": "evaluation",
    "estimate_fisher": "fisher",
    "CFP": "integrations",
    "CFPCallback": "integrations",
    "KLToBaseCallback": "integrations",
}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY_EXPORTS)

__all__ = [
    "CFP",
    "CFPCallback",
    "CFPError",
    "FisherAnchor",
    "KLToBaseCallback",
    "__version__",
    "estimate_fisher",
    "kl_to_base",
]
