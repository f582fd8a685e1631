"""Is an anchor still right? Re-estimate F at the current weights theta_t on the same calibration prompts, with
the settings the anchor was estimated with, and compare the top-1% coordinate sets:

    top1_overlap_now = |T(F(theta0)) ∩ T(F(theta_t))| / |T|,    T the top ceil(0.01 n) coordinates,

over the anchor's parameters (for a K-FAC anchor: over the diagonal of A (x) G and its diagonal F,
`geometry.kronecker.views.ImpliedDiagonal`, since two estimates' eigenbases need not agree). The cost is one
`estimate_fisher` call with the anchor's own sizes (its `num_sequences` responses of up to its `max_new_tokens`),
about the time it took to build the anchor.
"""

from transformers.utils import logging

from ..anchor import FisherAnchor
from ..anchor.compare import layout_difference
from ..errors import AnchorMismatchError
from ..geometry.kronecker.views import ImpliedDiagonal
from ..ops.order_statistics import top_overlap
from ..parallel.processes import log_on_main_process
from .estimate import estimate_fisher

logger = logging.get_logger(__name__)


def reestimate(anchor: FisherAnchor, model, tokenizer, prompts, show_progress: bool = False) -> FisherAnchor:
    """F of `model` at its current weights on `prompts`, with `anchor`'s estimator, sampler (temperature,
    top-k, top-p, max_new_tokens), num_sequences, num_samples_per_prompt and seed, restricted to the anchor's
    parameters and named `<anchor>_now`. Logs a warning when `prompts` are not the anchor's calibration
    prompts (their sha256 differs)."""
    meta = anchor.metadata
    sampler = meta.get("sampler") or {}
    fresh = estimate_fisher(
        model,
        tokenizer,
        prompts,
        num_sequences=int(meta.get("num_sequences", 128)),
        max_new_tokens=int(sampler.get("max_new_tokens", 256)),
        seed=int(meta.get("seed", 0)),
        temperature=float(sampler.get("temperature", 1.0)),
        top_k=sampler.get("top_k"),
        top_p=float(sampler.get("top_p", 1.0)),
        name=f"{anchor.name}_now",
        estimator=meta.get("estimator", "sequence"),
        num_samples_per_prompt=int(meta.get("num_samples_per_prompt", 1)),
        show_progress=show_progress,
        structure=anchor.structure,
        kfac_rank=meta.get("kfac_rank") if anchor.kfac else None,
    )
    if meta.get("prompts_sha256") not in (None, fresh.metadata["prompts_sha256"]):
        log_on_main_process(
            logger.warning_once,
            "Re-estimating anchor %r on prompts other than its calibration prompts (sha256 differs): the overlap "
            "then mixes a change of prompts with the change of weights.",
            anchor.name,
        )
    missing = [n for n in anchor.fisher if n not in fresh.fisher] + [n for n in anchor.kfac if n not in fresh.kfac]
    if missing:
        raise AnchorMismatchError(
            f"Anchor {anchor.name!r} covers {missing[0]!r} ({len(missing)} such), which the model no longer trains; "
            "re-estimate on the model the anchor was built for, with the same parameters trainable."
        )
    return FisherAnchor(
        {n: fresh.fisher[n] for n in anchor.fisher},
        name=fresh.name,
        metadata=fresh.metadata,
        kfac={n: fresh.kfac[n] for n in anchor.kfac} or None,
    )


def top1_overlap(anchor: FisherAnchor, fresh: FisherAnchor) -> float:
    """The share of the anchor's top-1% coordinates (by F) that are also in the fresh estimate's top 1%."""
    ours, theirs = ImpliedDiagonal(anchor.fisher, anchor.kfac), ImpliedDiagonal(fresh.fisher, fresh.kfac)
    difference = layout_difference(ours, theirs)
    if difference is not None:
        raise AnchorMismatchError(f"Cannot compare {anchor.name!r} with {fresh.name!r}: {difference}.")
    names = list(ours)
    return top_overlap([ours[n] for n in names], [theirs[n] for n in names], 0.01)
