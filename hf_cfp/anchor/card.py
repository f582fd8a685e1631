"""The model card pushed next to an anchor, rendered from the package's `templates/fisher_anchor.md`
(also shown at the repository's `model_cards/fisher_anchor.md`)."""

from importlib import resources

from huggingface_hub import ModelCard, ModelCardData

from ..geometry.base import NamedFisher
from ..geometry.kronecker.views import AnchorWeights
from .statistics import concentration

TAGS = ["cfp", "fisher-anchor", "hf-cfp"]


def render_card(anchor: NamedFisher, reference: str) -> ModelCard:
    """A ModelCard with `base_model:` metadata and tags, statistics and limitations."""
    meta, stats = anchor.metadata, anchor.metadata["statistics"]
    base = meta.get("base_model")
    card_data = ModelCardData(
        base_model=base if base and "/" in base and " " not in base else None, library_name="hf-cfp", tags=TAGS
    )
    shape = concentration(AnchorWeights(anchor.fisher, anchor.kfac))
    template = resources.files(__package__).joinpath("templates/fisher_anchor.md").read_text(encoding="utf-8")
    return ModelCard.from_template(
        card_data,
        template_str=template,
        name=anchor.name,
        reference=reference,
        kfac_weights=len(anchor.kfac),
        kfac_rank=meta.get("kfac_rank") or "full",
        kfac_tails=f"{kfac['tail_share']:.0%}" if (kfac := meta.get("kfac")) and kfac.get("truncated") else None,
        base_model=base,
        base_revision=meta.get("base_model_revision"),
        num_prompts=meta.get("num_prompts", "?"),
        prompts_sha256=meta.get("prompts_sha256", "not recorded"),
        num_sequences=meta.get("num_sequences", "?"),
        num_samples_per_prompt=meta.get("num_samples_per_prompt", 1),
        mean_response_tokens=f"{meta.get('mean_response_tokens', float('nan')):.1f}",
        estimator=meta.get("estimator", "not recorded"),
        sampler=meta.get("sampler") or "labels (empirical)",
        num_parameters=f"{stats['num_parameters']:,}",
        library_version=meta.get("library_version", "?"),
        created_at=meta.get("created_at", "?"),
        suggested_lam=f"{1 / stats['p99']:.3g}" if stats["p99"] > 0 else "1.0",
        total_mass=f"{stats['total_mass']:.4g}",
        mean=f"{stats['mean']:.3g}",
        p99=f"{stats['p99']:.3g}",
        max=f"{stats['max']:.3g}",
        top_shares={k: f"{v:.1%}" for k, v in shape["top_shares"].items()},
        module_types=[
            {**row, "share": f"{row['share']:.1%}", "count": f"{row['count']:,}"} for row in shape["module_types"]
        ],
    )
