"""The trace CFP leaves of a protected run, where a user looks for it, and never in the model's config:

- tags on the model, `cfp` and `cfp-anchor:<reference or name>` per protecting anchor (`add_model_tags`, at
  train begin): `Trainer.push_to_hub` (`create_model_card`) writes them into the Hub card's metadata, as TRL's
  trainers tag theirs;
- `cfp_provenance.json` in `args.output_dir`, written by the main process at train end: the anchors, the strength
  and the final drift metrics. `output_dir` is where `trainer.save_model()` saves by default and the folder
  `Trainer.push_to_hub` uploads, so the file travels with the saved model.

The model's `config` (its `config.json`) is left as the user made it.
"""

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..anchor import FisherAnchor
from ..anchor.combine import hub_reference

TAG = "cfp"
PROVENANCE_FILE = "cfp_provenance.json"


def anchor_references(anchors: Sequence[FisherAnchor]) -> list[dict[str, str | None]]:
    """[{"name", "reference"}] per anchor: its name and its Hub reference `org/repo@revision:path` (None when it
    was not loaded from the Hub)."""
    return [{"name": a.name, "reference": hub_reference(a)} for a in anchors]


def tag_model(model: torch.nn.Module, anchors: Sequence[FisherAnchor]) -> None:
    """Tag `model` with `cfp` and `cfp-anchor:<reference or name>` per protecting anchor (`add_model_tags`). On a
    PeftModel its base model is tagged; a model without `add_model_tags` is left alone."""
    get_base_model = getattr(model, "get_base_model", None)  # a PeftModel: tag its base model
    target = get_base_model() if callable(get_base_model) else model
    add_model_tags = getattr(target, "add_model_tags", None)
    if callable(add_model_tags):
        references = anchor_references(anchors)
        add_model_tags([TAG] + [f"cfp-anchor:{r['reference'] or r['name']}" for r in references])


def write_provenance(
    directory: str | os.PathLike,
    anchors: Sequence[FisherAnchor],
    strength: Mapping[str, Any],
    metrics: Mapping[str, float],
    step: int,
) -> Path:
    """Write `<directory>/cfp_provenance.json` = {"anchors": `anchor_references`, the `strength` ("lam" and
    "scale_lam_with_lr", "kl_budget" and its starting "lam", or "predicted_kl_budget"), "global_step": `step`,
    "final_metrics": {key: float}} (the drift metrics after the last step) and return its path; the directory is
    created if missing."""
    path = Path(directory) / PROVENANCE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "anchors": anchor_references(anchors),
        **strength,
        "global_step": step,
        "final_metrics": {key: float(value) for key, value in metrics.items()},
    }
    path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return path
