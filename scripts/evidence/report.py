"""Tables and plots of the evidence experiment, from its result rows (`run.run_experiment`).

- Drift table (the paper's): rows are methods at the table strength, columns are domains, entries are
  DtFD_d(arm) / DtFD_d(unregularized, same optimizer and seed) - 1, mean +- standard deviation over seeds
  (the value alone where one seed ran).
- Capability table: per row the task's progress (`measure.TASK_PROGRESS`), each domain's kl_to_base and the
  held-out scores, means over seeds (the base model as the first row).
- Frontier: task progress against math kl_to_base, one curve per method over its strengths (means over seeds),
  each starting at the unregularized run; and the same for CFP with math anchors of different quality (first
  seed only).
"""

import statistics
from collections import defaultdict
from pathlib import Path

from .measure import TASK_PROGRESS
from .plan import DOMAINS

LABELS = {"unregularized": "unregularized", "kl": "KL control", "step_only": "step-only", "isotropic": "isotropic"}


def curve_label(arm: dict) -> str:
    """The method and its anchor, strength left out: 'CFP [math]', 'KL control', 'step-only [math]', ..."""
    if arm["method"] == "cfp":
        return f"CFP [{arm['anchor']}]"
    return LABELS[arm["method"]] + (f" [{arm['anchor']}]" if arm["anchor"] else "")


def row_label(arm: dict, with_strength: bool = False) -> str:
    """A table row: `curve_label` with beta for the KL control ('KL control (beta 0.3)'), and with
    `with_strength` the strength of the others ('CFP [math] c=10')."""
    if arm["method"] == "kl":
        return curve_label(arm) + f" (beta {arm['strength']:g})"
    return curve_label(arm) + (f" c={arm['strength']:g}" if with_strength and arm["method"] != "unregularized" else "")


def _mean_sd(values: list[float], spec: str, sd_spec: str) -> str:
    """'mean ± sample standard deviation' over seeds, or the value alone from one seed."""
    mean = format(statistics.fmean(values), spec)
    return f"{mean} ± {format(statistics.stdev(values), sd_spec)}" if len(values) > 1 else mean


def _group(rows: list[dict], optimizer: str, predicate, with_strength: bool) -> dict[str, list[dict]]:
    """{row label: [result rows over seeds]} of one optimizer's arms that satisfy `predicate(arm)`, in run order."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        arm = row.get("arm")
        if arm and arm["optimizer"] == optimizer and predicate(arm):
            groups[row_label(arm, with_strength)].append(row)
    return groups


def drift_table(rows: list[dict], optimizer: str, is_table_row, with_strength: bool = False) -> str:
    """Markdown: relative DtFD per domain against the same seed's unregularized run."""
    reference = {
        r["arm"]["seed"]: r["metrics"]
        for r in rows
        if r.get("arm", {}).get("method") == "unregularized"
        if r["arm"]["optimizer"] == optimizer
    }
    lines = [f"| {optimizer.upper()} arm | " + " | ".join(f"{d} DtFD" for d in DOMAINS) + " |", "|---" * 4 + "|"]
    for label, group in _group(rows, optimizer, is_table_row, with_strength).items():
        cells = []
        for d in DOMAINS:
            if group[0]["arm"]["method"] == "unregularized":
                cells.append(_mean_sd([r["metrics"][f"{d}/dtfd"] for r in group], ".3g", ".2g") + " (abs.)")
            else:
                ratios = [r["metrics"][f"{d}/dtfd"] / reference[r["arm"]["seed"]][f"{d}/dtfd"] - 1 for r in group]
                cells.append(_mean_sd(ratios, "+.0%", ".0%"))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


CAPABILITY_COLUMNS = [
    ("math/kl", "math KL", ".3g"),
    ("code/kl", "code KL", ".3g"),
    ("safety/kl", "safety KL", ".3g"),
    ("math/log_lik", "math LL", ".3f"),
    ("math/exact_match", "math EM", ".0%"),
    ("code/log_lik", "code LL", ".3f"),
    ("safety/log_lik", "safety LL", ".3f"),
    ("safety/refusal_rate", "refusals", ".0%"),
]


def capability_table(rows: list[dict], optimizer: str, is_table_row) -> str:
    """Markdown: task progress, kl_to_base per domain and held-out scores (means over seeds)."""
    task = TASK_PROGRESS[optimizer]
    header = [f"{optimizer.upper()} arm", task] + [name for _, name, _ in CAPABILITY_COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    base = next(r for r in rows if r["key"] == "base")
    groups = {"base model": [base], **_group(rows, optimizer, is_table_row, False)}
    for label, group in groups.items():
        cells = []
        for key, _, spec in [(task, task, ".3g"), *CAPABILITY_COLUMNS]:
            values = [r["metrics"][key] for r in group if key in r["metrics"]]
            cells.append(format(statistics.fmean(values), spec) if values else "")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def frontier_points(rows: list[dict], optimizer: str, anchors, seeds=None) -> dict[str, list[tuple[float, float]]]:
    """{curve: [(math kl, task progress), ...]}: each method's arms whose anchor is in `anchors` (None: no
    anchor) in strength order, means over `seeds` (all when None), each curve starting at the unregularized
    point."""
    task = TASK_PROGRESS[optimizer]
    cells: dict[tuple[str, float], list[dict]] = defaultdict(list)
    for row in rows:
        arm = row.get("arm")
        if not arm or arm["optimizer"] != optimizer or (seeds is not None and arm["seed"] not in seeds):
            continue
        if arm["anchor"] in anchors:
            cells[(curve_label(arm), arm["strength"])].append(row["metrics"])
    points = {
        key: (statistics.fmean(m["math/kl"] for m in ms), statistics.fmean(m[task] for m in ms))
        for key, ms in cells.items()
    }
    start = [p for (label, _), p in points.items() if label == "unregularized"]
    curves: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for (label, _), point in sorted(points.items()):
        if label != "unregularized":
            curves[label].append(point)
    return {label: start + curve for label, curve in curves.items()}


def plot_frontiers(rows: list[dict], optimizers, quality_seed: int, path: Path) -> None:
    """One panel per optimizer (all methods) and one for the anchor-quality sweep (SFT), all from the seed
    that ran every strength (`quality_seed`)."""
    import matplotlib  # optional (the `demo` extra): only `--plot` needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after choosing the Agg backend: no display needed

    methods = (None, "math")
    seed = {quality_seed}
    panels = [
        (o, frontier_points(rows, o, methods, seed), f"{o.upper()}: methods (seed {quality_seed})") for o in optimizers
    ]
    math_anchors = {row["arm"]["anchor"] for row in rows if str(row.get("arm", {}).get("anchor")).startswith("math")}
    quality = frontier_points(rows, "sft", math_anchors, seed)
    quality = {label: curve for label, curve in quality.items() if label.startswith(("CFP", "isotropic"))}
    panels.append(("sft", quality, f"SFT: math anchors of other sizes / estimator (seed {quality_seed})"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2))
    for ax, (optimizer, curves, title) in zip(axes, panels, strict=True):
        for label, points in curves.items():
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=4, label=label)
        ax.set_xlabel("math kl_to_base (nats, held-out prompts)  →  capability lost")
        ax.set_ylabel(f"{TASK_PROGRESS[optimizer]}  →  task learned")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)
    fig.suptitle("Frontier: task progress vs capability KL; each curve from the unregularized run, stronger → left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown_report(rows: list[dict], optimizers, is_table_row) -> str:
    """Both tables for every optimizer, and the anchor-quality table, as one markdown document."""
    parts = []
    for optimizer in optimizers:
        parts += [
            f"### {optimizer.upper()}: quadratic sensitive drift vs the unregularized run",
            drift_table(rows, optimizer, is_table_row),
            f"### {optimizer.upper()}: task progress and held-out capability",
            capability_table(rows, optimizer, is_table_row),
        ]
    if "sft" in optimizers:
        parts += [
            "### SFT: every arm (all strengths, quality anchors)",
            drift_table(rows, "sft", lambda arm: True, True),
        ]
    return "\n\n".join(parts) + "\n"
