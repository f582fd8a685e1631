"""The Fisher anchor artifact: tensors and metadata (`artifact`), files on disk (`storage`), the Hub
(`hub`), its model card (`card`), statistics of F (`statistics`), two Fishers compared (`compare`),
anchors combined (`combine`), and the fingerprint that ties it to its base model (`fingerprint`)."""

from .artifact import FisherAnchor, validate_anchor_name
from .fingerprint import check_fingerprint, model_fingerprint

__all__ = ["FisherAnchor", "check_fingerprint", "model_fingerprint", "validate_anchor_name"]
