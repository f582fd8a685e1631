"""The trace CFP leaves in the model it protected: a `cfp` tag for the Hub card, and what protected it in the
model's config (saved with it in config.json)."""

from collections.abc import Sequence
from typing import Any

import torch

from ..anchor import FisherAnchor
from ..anchor.combine import hub_reference

TAG = "cfp"


def record_trace(
    model: torch.nn.Module, anchors: Sequence[FisherAnchor], strength: dict[str, Any], metrics: dict | None = None
) -> None:
    """Tag `model` with `cfp` and `cfp-anchor:<reference or name>` per protecting anchor (`add_model_tags`, which
    `Trainer.push_to_hub` puts in the card's tags, as TRL trainers tag theirs), and set `config.cfp` = {"anchors":
    [{"name", "reference"}], the strength ("lam" or "kl_budget"), and the final drift `metrics` when given}. On a
    PeftModel its base model is tagged; a model without `add_model_tags` or `config` is left alone."""
    get_base_model = getattr(model, "get_base_model", None)  # a PeftModel: tag and configure its base model
    target = get_base_model() if callable(get_base_model) else model
    references = [{"name": a.name, "reference": hub_reference(a)} for a in anchors]
    add_model_tags = getattr(target, "add_model_tags", None)
    if callable(add_model_tags):
        add_model_tags([TAG] + [f"cfp-anchor:{r['reference'] or r['name']}" for r in references])
    config = getattr(target, "config", None)
    if config is not None:
        trace = {"anchors": references, **strength}
        if metrics is not None:
            trace["final_metrics"] = {k: float(v) for k, v in metrics.items()}
        config.cfp = trace
