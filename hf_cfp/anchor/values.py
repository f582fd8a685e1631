"""The values an anchor's F may hold: finite and >= 0 (a mean of squared scores), checked per tensor."""

import torch

from ..errors import AnchorValidationError


def check_fisher_values(name: str, tensor: torch.Tensor, anchor_name: str) -> None:
    """Raise AnchorValidationError naming the anchor and parameter when `tensor` holds NaN, Inf or F_i < 0."""
    bad = ~torch.isfinite(tensor)
    if bad.any():
        raise AnchorValidationError(
            f"Anchor {anchor_name!r}: parameter {name!r} has {int(bad.sum())} NaN/Inf Fisher values. "
            "The anchor is corrupt or its estimation overflowed; re-estimate it (in float32)."
        )
    negative = tensor < 0
    if negative.any():
        raise AnchorValidationError(
            f"Anchor {anchor_name!r}: parameter {name!r} has {int(negative.sum())} negative Fisher values "
            f"(min {float(tensor.min()):.3g}). A diagonal Fisher is a mean of squares; re-estimate the anchor."
        )
