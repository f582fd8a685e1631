"""Turn what a user passes as an anchor (object, directory, Hub reference) into a FisherAnchor,
computing it at train begin when the Hub has none and calibration prompts were given."""

import os
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from ..anchor import FisherAnchor
from ..anchor.hub import parse_reference
from ..errors import AnchorNotFoundError
from ..fisher import estimate_fisher
from ..parallel import process_rank_and_count


@dataclass
class PendingAnchor:
    """An anchor to estimate from `prompts` on the model about to be trained (at theta0), then
    optionally push to where it was looked for."""

    reference: str
    prompts: Any
    push: bool = False
    estimate_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        _, _, subfolder = parse_reference(self.reference)
        return self.estimate_kwargs.get("name") or (subfolder.rsplit("/", 1)[-1] if subfolder else "anchor")

    def compute(self, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase | None) -> FisherAnchor:
        anchor = estimate_fisher(model, tokenizer, self.prompts, **{**self.estimate_kwargs, "name": self.name})
        if self.push and process_rank_and_count()[0] == 0:
            repo_id, revision, subfolder = parse_reference(self.reference)
            anchor.push_to_hub(repo_id, path_in_repo=subfolder or None, revision=revision)
        return anchor


AnchorLike = FisherAnchor | str | os.PathLike


def load_anchor(anchor: AnchorLike) -> FisherAnchor:
    """`anchor` as given, or loaded lazily from a directory or Hub reference (`FisherAnchor.from_pretrained` with
    `lazy=True`: F stays in the files, and each process reads only the pieces it binds)."""
    return anchor if isinstance(anchor, FisherAnchor) else FisherAnchor.from_pretrained(os.fspath(anchor), lazy=True)


def resolve_anchor(
    anchor: AnchorLike,
    compute_if_missing: Any = None,
    push_if_computed: bool = False,
    estimate_kwargs: dict[str, Any] | None = None,
) -> FisherAnchor | PendingAnchor:
    """A FisherAnchor as given, loaded from a directory or Hub reference, or a PendingAnchor when
    it is not found and `compute_if_missing` holds calibration prompts."""
    if isinstance(anchor, FisherAnchor):
        return anchor
    try:
        return load_anchor(anchor)
    except AnchorNotFoundError:
        if compute_if_missing is None:
            raise
        return PendingAnchor(os.fspath(anchor), compute_if_missing, push_if_computed, dict(estimate_kwargs or {}))
