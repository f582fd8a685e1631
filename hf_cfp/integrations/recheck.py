"""Anchor staleness during training: every `every` optimizer steps, re-estimate each protecting anchor's F at
the current weights on its calibration prompts (`fisher.staleness.reestimate`) and report
`cfp/<anchor>/top1_overlap_now`; with `refresh`, the fresh F replaces the anchor's for the correction from then
on (theta0 is kept: the path is still measured and pulled toward the initial weights)."""

from collections.abc import Mapping
from typing import Any

from ..anchor import FisherAnchor
from ..errors import CFPArgumentError
from ..fisher.staleness import reestimate, top1_overlap
from ..names import TOP1_OVERLAP_NOW


class AnchorRecheck:
    """When and on which prompts to re-estimate the protecting anchors, and whether to adopt the result."""

    def __init__(self, *, every: int | None, prompts: Any, refresh: bool, anchor_names: list[str], prefix: str = ""):
        """Validated for protecting anchors named `anchor_names`; messages name the options `prefix` + name
        (`settings.ProtectionSettings.of`)."""
        if every is None:
            if prompts is not None or refresh:
                raise CFPArgumentError(
                    f"{prefix}recheck_prompts and {prefix}refresh_fisher need {prefix}recheck_every (optimizer steps)."
                )
        elif isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise CFPArgumentError(f"{prefix}recheck_every must be an integer >= 1 (optimizer steps), got {every!r}.")
        elif prompts is None:
            raise CFPArgumentError(
                f"{prefix}recheck_every needs {prefix}recheck_prompts: the anchors' calibration prompts."
            )
        by_name = dict(prompts) if isinstance(prompts, Mapping) else None
        if every is not None and by_name is None and len(anchor_names) > 1:
            raise CFPArgumentError(
                f"With several protecting anchors {anchor_names}, {prefix}recheck_prompts maps each anchor name to "
                "its calibration prompts."
            )
        if by_name is not None and set(by_name) != set(anchor_names):
            raise CFPArgumentError(
                f"{prefix}recheck_prompts names {sorted(by_name)}; the protecting anchors are {anchor_names}."
            )
        self.every = every
        self.prompts = by_name if by_name is not None else dict.fromkeys(anchor_names, prompts)
        self.refresh = refresh

    def due(self, step: int) -> bool:
        return self.every is not None and step % self.every == 0

    def run(self, anchors: list[FisherAnchor], model, tokenizer) -> tuple[dict[str, float], list[FisherAnchor] | None]:
        """({`cfp/<anchor>/top1_overlap_now`: overlap}, the fresh anchors under the original names when
        refreshing, else None). The overlap compares the anchor's original F (before any refresh) with F now.
        `tokenizer` may be None when the prompts are token ids."""
        overlaps, fresh = {}, []
        for anchor in anchors:
            now = reestimate(anchor, model, tokenizer, self.prompts[anchor.name])
            overlaps[TOP1_OVERLAP_NOW.key(anchor.name)] = top1_overlap(anchor, now)
            fresh.append(
                FisherAnchor(
                    now.fisher,
                    name=anchor.name,
                    metadata={**now.metadata, "refreshed_from": anchor.name},
                    kfac=now.kfac or None,
                )
            )
        return overlaps, fresh if self.refresh else None
