"""The Fisher anchor artifact: tensors and metadata (`artifact`), its config file (`config`), files on disk
(`storage`), the Hub (`hub`), its model card (`card`), statistics of F (`statistics`), two Fishers compared
(`compare`), anchors combined (`combine`), and the fingerprint that ties it to its base model (`fingerprint`).

The names below are imported on first use (module `__getattr__`, PEP 562): `hf_cfp.anchor.config` reads an
anchor's metadata without torch (`hf-cfp inspect`).
"""

from typing import TYPE_CHECKING

from ..exports import lazy_exports

if TYPE_CHECKING:  # what the lazy names below resolve to, for type checkers
    from .artifact import FisherAnchor
    from .config import validate_anchor_name
    from .fingerprint import check_fingerprint, model_fingerprint

# public name -> the module that defines it, imported when the name is first read
_LAZY_EXPORTS = {
    "FisherAnchor": "artifact",
    "validate_anchor_name": "config",
    "check_fingerprint": "fingerprint",
    "model_fingerprint": "fingerprint",
}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY_EXPORTS)

__all__ = ["FisherAnchor", "check_fingerprint", "model_fingerprint", "validate_anchor_name"]
