"""Combine anchors of one base model: F = sum_k w_k F_k, with the parts listed in the metadata."""

import math
from collections.abc import Sequence

import torch

from ..errors import AnchorMismatchError, CFPArgumentError, plural
from ..geometry.base import NamedFisher
from ..geometry.kronecker.artifact import dense_factors
from .compare import layout_difference

BASE_MODEL_KEYS = ("base_model", "base_model_revision", "base_fingerprint")  # what ties an anchor to its base


def combine_parts(anchors: Sequence[NamedFisher], weights: Sequence[float] | None) -> tuple[dict, dict, dict]:
    """(fisher, metadata, kfac) of `FisherAnchor.combine`: F = sum_k w_k F_k summed in float64 (w_k = 1/K by
    default), the parts' shared base-model entries, and `combined_from` listing each part's name, weight
    and reference; for K-FAC parts the pooled factors of each K-FAC weight (`_pooled_factors`). Refuses bad
    weights (CFPArgumentError) and parts that differ in tensor names, shapes, structure or base-model metadata
    (AnchorMismatchError naming the first difference)."""
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
    kfac = _pooled_factors(anchors, weights)
    metadata = {key: first.metadata[key] for key in BASE_MODEL_KEYS if key in first.metadata}
    if kfac:
        metadata.update(num_tokens=sum(float(p.metadata["num_tokens"]) for p in anchors))
    metadata["combined_from"] = [
        {"name": part.name, "weight": float(weight), "reference": hub_reference(part)}
        for part, weight in zip(anchors, weights, strict=True)
    ]
    return fisher, metadata, kfac


def _pooled_factors(anchors: list[NamedFisher], weights: list[float]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """For K-FAC parts, each weight's factors as the estimator would give for the parts' sequences together (with
    w_k = 1/K and parts of equally many sequences): G = sum_k w_k G_k (G is a mean over sequences) and
    A = sum_k w_k T_k A_k / sum_k w_k T_k (A is a mean over the T_k tokens, `metadata["num_tokens"]`), float64.
    Dense factors are exact only from full bases: truncated parts are refused."""
    first = anchors[0]
    if not first.kfac:
        return {}
    for part in anchors:
        truncated = [
            n
            for n, b in part.kfac.items()
            if b.a_vectors.shape[1] < b.a_vectors.shape[0] or b.g_vectors.shape[1] < b.g_vectors.shape[0]
        ]
        if truncated or "num_tokens" not in part.metadata:
            why = f"its basis of {truncated[0]!r} is truncated" if truncated else "it does not record num_tokens"
            raise CFPArgumentError(
                f"Cannot combine K-FAC anchor {part.name!r}: {why}, so its factors cannot be pooled exactly. "
                "Combine full-rank K-FAC anchors from estimate_fisher(structure='kfac'), or estimate one anchor on "
                "all the sequences."
            )
    tokens = [float(w) * float(p.metadata["num_tokens"]) for p, w in zip(anchors, weights, strict=True)]
    pooled = {}
    for name in first.kfac:
        parts = [dense_factors(p.kfac[name]) for p in anchors]
        a = torch.stack([t * pa.double() for t, (pa, _) in zip(tokens, parts, strict=True)]).sum(0) / sum(tokens)
        g = torch.stack([w * pg.double() for w, (_, pg) in zip(weights, parts, strict=True)]).sum(0)
        pooled[name] = (a, g)
    return pooled


def _check_compatible(first: NamedFisher, part: NamedFisher) -> None:
    if sorted(first.kfac) != sorted(part.kfac):
        raise AnchorMismatchError(
            f"Cannot combine anchors {first.name!r} and {part.name!r}: they factor different weights "
            f"({len(first.kfac)} and {len(part.kfac)} K-FAC weights). Combine anchors of one structure, estimated "
            "for the same base model."
        )
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
