"""The anchors of the evidence experiment by name (`Plan.anchor_specs`): estimated once and saved under
`<output_dir>/anchors/<name>`, pooled from saved parts, or derived (isotropic; truncated to a rank or a trace
share, with a zero or a mean tail) when loaded.

A full-rank K-FAC anchor of the embedded model holds about 1.2 GB of eigenbases (3 floats per covered
parameter), so `AnchorStore` keeps a K-FAC anchor in memory only while an arm uses it (`for_arm`), and pools
K-FAC parts as a balanced tree of pairwise means, two halves in memory at a time (`_pairwise`). Each mean is
exact: the two halves hold equally many sequences, so the mean of their G is that of all their sequences, and
`FisherAnchor.combine` weights their A by their tokens (`metadata["num_tokens"]`).
"""

from collections.abc import Iterable
from pathlib import Path

from hf_cfp.anchor import FisherAnchor
from hf_cfp.fisher import estimate_fisher
from hf_cfp.loading.prompts import calibration_prompts

from .controls import isotropic_anchor, share_truncated_anchor, truncated_anchor
from .plan import DOMAINS, AnchorSpec, Plan

SAVED = ("estimated", "pooled")  # the kinds made once and saved; the others are derived when loaded


def pooled(parts: list[FisherAnchor], name: str) -> FisherAnchor:
    """The anchor of all the parts' sequences together: F = (1/K) sum_k F_k for K parts of equally many
    sequences drawn with different seeds (a mean of independent per-sequence squared scores), by
    `FisherAnchor.combine` (its metadata lists the parts in `combined_from`; K-FAC parts: their pooled
    factors, G the mean, A the token-weighted mean)."""
    return FisherAnchor.combine(parts, name=name)


class AnchorStore:
    """The plan's anchors for `model`, made on first use (`fetch`), kept in memory by `get` / `for_arm`.

    Args:
        model, tokenizer: the base model the anchors are estimated on.
        plan: the sizes (`anchor_new_tokens`) and the specs (`Plan.anchor_specs`).
        directory: where estimated and pooled anchors are saved, `directory/<name>`.
    """

    def __init__(self, model, tokenizer, plan: Plan, directory: Path):
        self.model, self.tokenizer, self.plan, self.directory = model, tokenizer, plan, Path(directory)
        self.specs = plan.anchor_specs()
        self.loaded: dict[str, FisherAnchor] = {}

    def is_saved(self, name: str) -> bool:
        return (self.directory / name / "cfp_config.json").exists()

    def fetch(self, name: str) -> FisherAnchor:
        """Anchor `name`: from memory, from its directory, derived from its source, or made now and saved."""
        if name in self.loaded:
            return self.loaded[name]
        spec = self.specs[name]
        if spec.kind == "isotropic":
            return isotropic_anchor(self.fetch(str(spec.source)), name)
        if spec.kind == "truncated":
            source = self.fetch(str(spec.source))
            if spec.share is not None:
                return share_truncated_anchor(source, spec.share, name)
            return truncated_anchor(source, int(spec.rank or 0), name, spec.tail)
        if self.is_saved(name):
            return FisherAnchor.from_pretrained(str(self.directory / name))
        anchor = self._estimate(name, spec) if spec.kind == "estimated" else self._pool(name, spec)
        anchor.save_pretrained(self.directory / name)
        return anchor

    def get(self, name: str) -> FisherAnchor:
        """`fetch`, kept in memory until a `for_arm` that does not need it (K-FAC) or for good (diagonal)."""
        self.loaded[name] = self.fetch(name)
        return self.loaded[name]

    def for_arm(self, names: Iterable[str]) -> dict[str, FisherAnchor]:
        """{name: anchor} for `names` (`Plan.anchors_of`); the K-FAC anchors kept for earlier arms and not named
        here are dropped from memory first."""
        names = set(names)
        for name in [n for n, anchor in self.loaded.items() if anchor.structure == "kfac" and n not in names]:
            del self.loaded[name]
        return {name: self.get(name) for name in self.dependencies(names) if name in names}

    def dependencies(self, names: Iterable[str]) -> list[str]:
        """`names` and every anchor they are made from (parts, sources), each before the anchors made from it."""
        order: list[str] = []

        def visit(name: str) -> None:
            spec = self.specs[name]
            for source in (*spec.parts, *([spec.source] if spec.source else [])):
                visit(source)
            if name not in order:
                order.append(name)

        for name in sorted(names):
            visit(name)
        return order

    def missing(self, names: Iterable[str]) -> list[str]:
        """The anchors (with their parts) still to estimate or pool for `names`, in the order they are made."""
        return [n for n in self.dependencies(names) if self.specs[n].kind in SAVED and not self.is_saved(n)]

    def prepare(self, names: Iterable[str]) -> None:
        """Estimate or pool (and save) every anchor `names` need that is not saved yet, before the arms run, so
        that an arm's seconds are its own; what is made is not kept in memory."""
        for name in self.missing(names):
            if not self.is_saved(name):  # a pooled tree may have made it already
                self.fetch(name)

    def _estimate(self, name: str, spec: AnchorSpec) -> FisherAnchor:
        kind = ", K-FAC" if spec.structure == "kfac" else ""
        print(
            f"Estimating anchor {name!r}: {spec.sequences} {spec.domain} sequences, {spec.estimator} estimator, "
            f"seed {spec.seed}{kind}",
            flush=True,
        )
        return estimate_fisher(
            self.model,
            self.tokenizer,
            calibration_prompts(spec.domain),
            num_sequences=spec.sequences,
            max_new_tokens=self.plan.anchor_new_tokens,
            batch_size=8,
            seed=spec.seed,
            name=name,
            estimator=spec.estimator,
            structure=spec.structure,
        )

    def _pool(self, name: str, spec: AnchorSpec) -> FisherAnchor:
        """All parts at once (`pooled`), or for K-FAC parts of a power-of-two count the pairwise tree."""
        count = len(spec.parts)
        if spec.structure == "kfac" and count & (count - 1) == 0:
            return self._pairwise(name, spec.parts)
        return pooled([self.fetch(part) for part in spec.parts], name)

    def _pairwise(self, name: str, parts: tuple[str, ...]) -> FisherAnchor:
        """The pooled anchor of `parts` (a power-of-two count) as the mean of its two halves' pooled anchors; a
        half that is itself a planned anchor (e.g. the 64-sequence one inside the 128) is fetched, not rebuilt.
        The second half is made first, so its parts leave memory before the first half is read."""
        if len(parts) == 1:
            return self.fetch(parts[0])
        half = len(parts) // 2
        right = self._half(f"{name}_b", parts[half:])
        left = self._half(f"{name}_a", parts[:half])
        return pooled([left, right], name)

    def _half(self, name: str, parts: tuple[str, ...]) -> FisherAnchor:
        planned = [n for n, s in self.specs.items() if s.kind == "pooled" and s.parts == parts]
        return self.fetch(planned[0]) if planned else self._pairwise(name, parts)


def load_or_estimate_anchors(model, tokenizer, plan: Plan, directory: Path) -> dict[str, FisherAnchor]:
    """The diagonal anchors of the first experiment, in memory: the math, code and safety anchors
    (`plan.anchor_sequences` each, sequence estimator, seed 0); the quality sweep's math anchors
    (`plan.quality_anchors`: a multiple K of `anchor_sequences` pools K parts of seeds 0..K-1, any other size is
    estimated on its own); and `isotropic` (math's F replaced by its mean). Each estimate is saved to / loaded
    from `directory/<name>`."""
    store = AnchorStore(model, tokenizer, plan, directory)
    return store.for_arm([*DOMAINS, *plan.quality_anchors(), "isotropic"])
