"""Turn what a user passes as an anchor (object, directory, Hub reference) into a FisherAnchor,
computing it at train begin when the Hub has none and calibration prompts were given."""

import os
from dataclasses import dataclass, field

from .anchor import FisherAnchor
from .distributed import process_rank_and_count
from .errors import AnchorNotFoundError
from .hub import parse_reference


@dataclass
class PendingAnchor:
    """An anchor to estimate from `prompts` on the model about to be trained (at theta0), then
    optionally push to where it was looked for."""

    reference: str
    prompts: object
    push: bool = False
    estimate_kwargs: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        _, _, subfolder = parse_reference(self.reference)
        return self.estimate_kwargs.get("name") or (subfolder.rsplit("/", 1)[-1] if subfolder else "anchor")

    def compute(self, model, tokenizer) -> FisherAnchor:
        from .fisher import estimate_fisher

        anchor = estimate_fisher(model, tokenizer, self.prompts, **{**self.estimate_kwargs, "name": self.name})
        if self.push and process_rank_and_count()[0] == 0:
            repo_id, revision, subfolder = parse_reference(self.reference)
            anchor.push_to_hub(repo_id, path_in_repo=subfolder or None, revision=revision)
        return anchor


def resolve_anchor(anchor, compute_if_missing=None, push_if_computed: bool = False, estimate_kwargs=None):
    """A FisherAnchor as given, loaded from a directory or Hub reference, or a PendingAnchor when
    it is not found and `compute_if_missing` holds calibration prompts."""
    if isinstance(anchor, FisherAnchor):
        return anchor
    try:
        return FisherAnchor.from_pretrained(os.fspath(anchor))
    except AnchorNotFoundError:
        if compute_if_missing is None:
            raise
        return PendingAnchor(os.fspath(anchor), compute_if_missing, push_if_computed, dict(estimate_kwargs or {}))
