"""Combine anchors of one base model: F = sum_k w_k F_k, with the parts listed in the metadata."""

import math
from collections.abc import Sequence

import torch

from ..errors import AnchorMismatchError, CFPArgumentError, plural
from .compare import layout_difference
from .protocol import NamedFisher

BASE_MODEL_KEYS = ("base_model", "base_model_revision", "base_fingerprint")  # what ties an anchor to its base


def combine_parts(anchors: Sequence[NamedFisher], weights: Sequence[float] | None) -> tuple[dict, dict]:
    """(fisher, metadata) of `FisherAnchor.combine`: F = sum_k w_k F_k summed in float64 (w_k = 1/K by
    default), the parts' shared base-model entries, and `combined_from` listing each part's name, weight
    and reference. Refuses bad weights (CFPArgumentError) and parts that differ in tensor names, shapes
    or base-model metadata (AnchorMismatchError naming the first difference)."""
    anchors = list(anchors)
    if not anchors or not all(hasattr(a, "fisher") and hasattr(a, "metadata") for a in anchors):
        raise CFPArgumentError("FisherAnchor.combine needs a non-empty list of FisherAnchor objects.")
    weights = [1.0 / len(anchors)] * len(anchors) if weights is None else list(weights)
    if len(weights) != len(anchors):
        raise CFPArgumentError(
            f"Got {plural(len(weights), 'weight')} for {plural(len(anchors), 'anchor')}; give one weight per anchor."
        )
    valid = all(
        isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) and w >= 0 for w in weights
    )
    if not valid or not any(weights):
        raise CFPArgumentError(f"Weights must be finite numbers >= 0, not all 0, one per anchor; got {weights!r}.")
    first = anchors[0]
    for part in anchors[1:]:
        _check_compatible(first, part)
    fisher = {}
    for key, tensor in first.fisher.items():
        total = torch.zeros(tensor.shape, dtype=torch.float64)
        for part, weight in zip(anchors, weights, strict=True):
            total.add_(part.fisher[key].double(), alpha=float(weight))
        fisher[key] = total.float()
    metadata = {key: first.metadata[key] for key in BASE_MODEL_KEYS if key in first.metadata}
    metadata["combined_from"] = [
        {"name": part.name, "weight": float(weight), "reference": hub_reference(part)}
        for part, weight in zip(anchors, weights, strict=True)
    ]
    return fisher, metadata


def _check_compatible(first: NamedFisher, part: NamedFisher) -> None:
    difference = layout_difference(first.fisher, part.fisher)
    if difference is not None:
        raise AnchorMismatchError(
            f"Cannot combine anchors {first.name!r} and {part.name!r}: {difference}. Combine anchors estimated "
            "for the same base model with the same trainable parameters."
        )
    for key in BASE_MODEL_KEYS:
        ours, theirs = first.metadata.get(key), part.metadata.get(key)
        if ours != theirs:
            shown = "" if key == "base_fingerprint" else f" ({ours!r} vs {theirs!r})"
            raise AnchorMismatchError(
                f"Cannot combine anchors {first.name!r} and {part.name!r}: their metadata {key!r} differs{shown}, "
                "so they were computed for different base models. Combine anchors of one base model."
            )


def hub_reference(anchor: NamedFisher) -> str | None:
    """`org/model@commit:subfolder` for an anchor loaded from the Hub (`metadata["hub"]`), else None."""
    hub = anchor.metadata.get("hub")
    if not isinstance(hub, dict) or not hub.get("repo_id"):
        return None
    return f"{hub['repo_id']}@{hub.get('commit') or hub.get('revision') or 'main'}:{hub.get('subfolder') or ''}"
