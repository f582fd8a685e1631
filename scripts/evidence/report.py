"""Tables and plots of the evidence experiment, from its result rows (`run.run_experiment`).

- Drift table (the paper's): rows are methods at the table strength, columns are domains, entries are
  DtFD_d(arm) / DtFD_d(unregularized, same optimizer and seed) - 1, mean +- standard deviation over seeds
  (the value alone where one seed ran). DtFD is always that of the diagonal anchors, CFP-KFAC rows included.
- Capability table: per row the task's progress (`measure.TASK_PROGRESS`), each domain's kl_to_base and the
  held-out scores, means over seeds (the base model as the first row). Both tables for SFT, DPO and each RL
  reward (`rloo-<reward>`: the task progress is the reward gain).
- Sweep tables (first seed, table strength): CFP-KFAC [math] with the anchor truncated to r eigenpairs per factor
  (`math_r<r>`) and with math K-FAC anchors of other sizes (`math_n<n>`), beside the full 32-sequence one.
- Rank and tail sweep (first seed, per optimizer, `rank_tail_table`): CFP-KFAC [math] with each truncation of
  the plan (`math_t<r>`, `math_r<r>`, `math_s<pct>`) beside full rank: math KL +- its standard error and task
  progress at each strength, the floats the bases store per factored parameter, and "math KL at equal task gain":
  the truncation's math KL interpolated at full rank's task progress at c = 1, linearly in log KL between
  consecutive strengths of its sweep (`kl_at_gain`; never extrapolated: "n/a"), and its ratio to full rank's KL
  there. Then `rank_tail_rule`: the smallest rank and the smallest trace share within `RULE_RATIO` of full rank on
  every optimizer. Arms not run yet show "—".
- Predicted vs measured: for the rows that have both, the diagonal prediction 0.5 DtFD_math, the K-FAC one
  (`math/kfac_predicted_kl`) and the measured held-out math KL.
- Frontier: task progress against math kl_to_base, one curve per method over its strengths (means over seeds),
  each starting at the unregularized run: per optimizer, for the diagonal quality sweep (SFT) and for the K-FAC
  sweeps (per optimizer: rank and anchor size; rank and tail, zero tails dashed), first seed only.
"""

import math
import re
import statistics
from collections import defaultdict
from pathlib import Path

from .measure import TASK_PROGRESS
from .plan import DOMAINS, Plan, rl_reward

MISSING = "—"  # a cell whose arm has not run (yet)
RULE_RATIO = 1.25  # a truncation keeps the protection when its math KL at equal task gain is within this of full
ZERO_TAIL = re.compile(r"_r[0-9]+\]")  # a curve of a zero-tail truncation, 'CFP-KFAC [math_r8]' (drawn dashed)
LABELS = {"unregularized": "unregularized", "kl": "KL control", "step_only": "step-only", "isotropic": "isotropic"}


def curve_label(arm: dict) -> str:
    """The method and its anchor, strength left out: 'CFP [math]', 'CFP-KFAC [math_r8]', 'KL control',
    'step-only [math]', ..."""
    if arm["method"] in ("cfp", "kfac"):
        return ("CFP" if arm["method"] == "cfp" else "CFP-KFAC") + f" [{arm['anchor']}]"
    return LABELS[arm["method"]] + (f" [{arm['anchor']}]" if arm["anchor"] else "")


def title(optimizer: str) -> str:
    """'SFT', 'DPO', 'RLOO (pirate reward)'."""
    reward = rl_reward(optimizer)
    return f"RLOO ({reward} reward)" if reward else optimizer.upper()


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
    lines = [f"| {title(optimizer)} arm | " + " | ".join(f"{d} DtFD" for d in DOMAINS) + " |", "|---" * 4 + "|"]
    for label, group in _group(rows, optimizer, is_table_row, with_strength).items():
        cells = []
        for d in DOMAINS:
            if group[0]["arm"]["method"] == "unregularized":
                cells.append(_mean_sd([r["metrics"][f"{d}/dtfd"] for r in group], ".3g", ".2g") + " (abs.)")
            else:
                pairs = [(r["metrics"][f"{d}/dtfd"], reference[r["arm"]["seed"]][f"{d}/dtfd"]) for r in group]
                ratios = [value / plain - 1 for value, plain in pairs if plain > 0]  # 0: the optimizer never moved
                cells.append(_mean_sd(ratios, "+.0%", ".0%") if ratios else "")
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
    header = [f"{title(optimizer)} arm", task] + [name for _, name, _ in CAPABILITY_COLUMNS]
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


def sweep_table(rows: list[dict], optimizer: str, labels: dict[str, str], strength: float, seed: int) -> str:
    """Markdown: the unregularized run, then one row per CFP-KFAC anchor label (`labels`: the arm's anchor label ->
    the row's name, in order) at `strength` on `seed`: task progress, each domain's kl_to_base, the diagonal math
    DtFD relative to the unregularized run, and the K-FAC math prediction. Labels that did not run are left out."""
    task = TASK_PROGRESS[optimizer]
    header = [f"{title(optimizer)} arm", task, *(f"{d} KL" for d in DOMAINS), "math DtFD", "K-FAC math pred. KL"]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    mine = [r for r in rows if r.get("arm", {}).get("optimizer") == optimizer and r["arm"]["seed"] == seed]
    plain = next((r["metrics"] for r in mine if r["arm"]["method"] == "unregularized"), None)
    found = {
        r["arm"]["anchor"]: r["metrics"]
        for r in mine
        if r["arm"]["method"] == "kfac" and r["arm"]["strength"] == strength and r["arm"]["anchor"] in labels
    }
    reference = plain["math/dtfd"] if plain else 0.0  # 0: no unregularized run, or one that never moved
    named = [("unregularized", plain)] if plain else []
    for label, metrics in [*named, *((labels[a], found[a]) for a in labels if a in found)]:
        dtfd = metrics["math/dtfd"]
        cells = [format(metrics[task], ".3g"), *(format(metrics[f"{d}/kl"], ".3g") for d in DOMAINS)]
        relative = metrics is not plain and reference > 0
        cells.append(f"{dtfd / reference - 1:+.0%}" if relative else f"(abs. {dtfd:.3g})")
        cells.append(format(metrics["math/kfac_predicted_kl"], ".3g") if "math/kfac_predicted_kl" in metrics else "")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rank_labels(plan: Plan) -> dict[str, str]:
    """{anchor label: row name} of the rank sweep: each truncation, then the full anchor."""
    return {**{f"math_r{r}": f"CFP-KFAC [math] rank {r}" for r in plan.kfac_ranks}, "math": "CFP-KFAC [math] full"}


def size_labels(plan: Plan) -> dict[str, str]:
    """{anchor label: row name} of the anchor-size sweep, in order of size (the table anchor among them)."""
    sizes = {n: f"math_n{n}" for n in plan.kfac_sizes} | {plan.anchor_sequences: "math"}
    return {sizes[n]: f"CFP-KFAC [math] {n} sequences" for n in sorted(sizes)}


def truncation_labels(plan: Plan) -> dict[str, str]:
    """{anchor label: row name} of the rank and tail sweep: full rank, each of `kfac_tail_ranks` with the mean and
    the zero tail, each of `kfac_shares` (mean tail)."""
    labels = {"math": "full rank"}
    for r in plan.kfac_tail_ranks:
        labels |= {f"math_t{r}": f"rank {r}, mean tail", f"math_r{r}": f"rank {r}, zero tail"}
    return labels | {f"math_s{pct}": f"{pct}% of trace, mean tail" for pct in plan.kfac_shares}


def kl_at_gain(points: list[tuple[float, float]], gain: float) -> float | None:
    """The math KL of a strength sweep at task progress `gain`: `points` are (task progress, math KL) in strength
    order; a point at exactly `gain` gives its KL, else the first pair of consecutive points whose progress
    brackets `gain` gives log KL interpolated linearly in progress. None when no pair brackets it (no
    extrapolation) or a KL there is not > 0."""
    for progress, kl in points:
        if progress == gain:
            return kl if kl > 0 else None
    for (g0, k0), (g1, k1) in zip(points, points[1:], strict=False):
        if min(g0, g1) < gain < max(g0, g1):
            if k0 <= 0 or k1 <= 0:
                return None
            t = (gain - g0) / (g1 - g0)
            return math.exp((1 - t) * math.log(k0) + t * math.log(k1))
    return None


def _sweep_cells(rows: list[dict], optimizer: str, seed: int) -> dict[tuple[str, float], dict]:
    """{(anchor label, strength): metrics} of the CFP-KFAC arms of `optimizer` on `seed`."""
    return {
        (r["arm"]["anchor"], r["arm"]["strength"]): r["metrics"]
        for r in rows
        if r.get("arm", {}).get("optimizer") == optimizer and r["arm"]["method"] == "kfac" and r["arm"]["seed"] == seed
    }


def equal_gain(rows: list[dict], plan: Plan, optimizer: str) -> tuple[float | None, dict[str, tuple]]:
    """(full rank's task progress at `table_strength`, {label: (math KL at that progress, ratio to full rank's
    KL)}) over `truncation_labels`, first seed, from the strengths that ran (`kl_at_gain`): a label with no arm is
    left out; (None, None) when its sweep does not reach that progress. No full-rank row: (None, {})."""
    task, cells = TASK_PROGRESS[optimizer], _sweep_cells(rows, optimizer, plan.seeds[0])
    full = cells.get(("math", plan.table_strength))
    if full is None:
        return None, {}
    target, reference = full[task], full["math/kl"]
    found = {}
    for label in truncation_labels(plan):
        ran = [cells[(label, c)] for c in plan.sweep_strengths() if (label, c) in cells]
        points = [(metrics[task], metrics["math/kl"]) for metrics in ran]
        if not points:
            continue
        kl = kl_at_gain(points, target)
        found[label] = (kl, kl / reference if kl is not None and reference > 0 else None)
    return target, found


def lower_bounds(rows: list[dict], plan: Plan, optimizer: str) -> dict[str, tuple[float, float]]:
    """{label: (a lower bound on the math KL at full rank's task progress, on its ratio to full rank's KL)} of the
    truncations whose every strength that ran stays below that progress (`equal_gain` has no value for them): the
    KL of the strength that got furthest, since a weaker pull, needed to get further, leaves the KL no lower (the
    sweep's points bear that out: the KL falls with the strength on every row)."""
    task, cells = TASK_PROGRESS[optimizer], _sweep_cells(rows, optimizer, plan.seeds[0])
    target, found = equal_gain(rows, plan, optimizer)
    reference = cells[("math", plan.table_strength)]["math/kl"] if target is not None else None
    bounds = {}
    for label, (kl, _) in found.items():
        points = [cells[(label, c)] for c in plan.sweep_strengths() if (label, c) in cells]
        if kl is None and reference and all(m[task] < target for m in points):
            furthest = max(points, key=lambda m: m[task])["math/kl"]
            bounds[label] = (furthest, furthest / reference)
    return bounds


def _floats(rows: list[dict], label: str) -> float | None:
    """The floats per factored parameter of `label`'s anchor (`kfac/floats_per_param` of any of its rows; full
    rank also `kfac/full_floats_per_param` of a math truncation's)."""
    for row in rows:
        anchor, metrics = row.get("arm", {}).get("anchor"), row["metrics"]
        if anchor == label and "kfac/floats_per_param" in metrics:
            return metrics["kfac/floats_per_param"]
        if label == "math" and "kfac/full_floats_per_param" in metrics and (anchor or "").startswith("math_"):
            return metrics["kfac/full_floats_per_param"]
    return None


def rank_tail_table(rows: list[dict], plan: Plan, optimizer: str) -> str:
    """Markdown: one row per truncation of `truncation_labels` (first seed), columns: floats per factored
    parameter; per strength of `sweep_strengths` the math KL +- its standard error and the task progress; the math
    KL at full rank's task progress at `table_strength` (`equal_gain`) and its ratio to full rank's KL. "—": not
    run (yet); ">= x": every strength that ran stays below full rank's task progress (`lower_bounds`); "n/a": the
    sweep's strengths all pass it."""
    task, cells = TASK_PROGRESS[optimizer], _sweep_cells(rows, optimizer, plan.seeds[0])
    target, at_gain = equal_gain(rows, plan, optimizer)
    bounds = lower_bounds(rows, plan, optimizer)
    strengths, c = plan.sweep_strengths(), plan.table_strength
    reached = f"{task} = {target:.3g}" if target is not None else f"full rank's c={c:g} {task}"
    header = [f"{title(optimizer)} truncation", "floats/param"]
    header += [f"c={s:g} {column}" for s in strengths for column in ("math KL", task)]
    header += [f"math KL at {reached}", "ratio to full"]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for label, name in truncation_labels(plan).items():
        floats = _floats(rows, label)
        entries = [format(floats, ".3g") if floats is not None else MISSING]
        for s in strengths:
            metrics = cells.get((label, s))
            if metrics is None:
                entries += [MISSING, MISSING]
                continue
            kl = format(metrics["math/kl"], ".3g")
            stderr = metrics.get("math/kl_stderr")
            entries += [kl + (f" ± {stderr:.2g}" if stderr is not None else ""), format(metrics[task], ".3g")]
        if target is None or label not in at_gain:
            entries += [MISSING, MISSING]
        elif label in bounds:
            entries += [f">= {bounds[label][0]:.3g}", f">= {bounds[label][1]:.2f}"]
        else:
            at, ratio = at_gain[label]
            entries += [
                format(at, ".3g") if at is not None else "n/a",
                f"{ratio:.2f}" if ratio is not None else "n/a",
            ]
        lines.append(f"| {name} | " + " | ".join(entries) + " |")
    return "\n".join(lines)


def rank_tail_rule(rows: list[dict], plan: Plan) -> str:
    """One sentence from the sweep's numbers: the smallest absolute rank (with the tails that pass there) and the
    smallest trace share whose ratio to full rank's math KL at equal task gain (`equal_gain`) is <= `RULE_RATIO`
    on every optimizer of the plan (SFT and DPO), or "none"; and how many truncations have a ratio on all of them
    (the others did not run or do not reach full rank's task progress)."""
    ratios = {optimizer: equal_gain(rows, plan, optimizer)[1] for optimizer in plan.optimizers}

    def ratio_everywhere(label: str) -> list[float] | None:
        found = [ratios[o].get(label, (None, None))[1] for o in plan.optimizers]
        return None if any(r is None for r in found) else found

    def passes(label: str) -> bool:
        found = ratio_everywhere(label)
        return found is not None and all(r <= RULE_RATIO for r in found)

    tails = {"t": "mean", "r": "zero"}
    ranks = sorted({r for r in plan.kfac_tail_ranks for x in tails if passes(f"math_{x}{r}")})
    rank = "none"
    if ranks:
        passing = [tail for x, tail in tails.items() if passes(f"math_{x}{ranks[0]}")]
        rank = f"{ranks[0]} ({' and '.join(passing)} tail{'s' if len(passing) > 1 else ''})"
    shares = [pct for pct in sorted(plan.kfac_shares) if passes(f"math_s{pct}")]
    share = f"{shares[0]}% (mean tail)" if shares else "none"
    cuts = [label for label in truncation_labels(plan) if label != "math"]
    measured = sum(ratio_everywhere(label) is not None for label in cuts)
    bounded = {o: lower_bounds(rows, plan, o) for o in plan.optimizers}
    worse = [
        label
        for label in cuts
        if any(label in bounded[o] and bounded[o][label][1] > RULE_RATIO for o in plan.optimizers)
    ]
    where = " and ".join(title(o) for o in plan.optimizers)
    return (
        f"Within {RULE_RATIO:g}x of full rank's math KL at equal task gain on {where}: the smallest absolute rank is "
        f"{rank}; the smallest trace share is {share}. {measured} of {len(cuts)} truncations have a ratio on "
        f"{'both optimizers' if len(plan.optimizers) == 2 else 'every optimizer'} (the others: {MISSING} not run, "
        "n/a outside their strengths)"
        + (f"; {len(worse)} more are above {RULE_RATIO:g}x on some optimizer by a lower bound (>=)." if worse else ".")
    )


def prediction_table(rows: list[dict]) -> str:
    """Markdown: per arm with a K-FAC prediction (means over seeds), the diagonal quadratic 0.5 DtFD_math, the
    K-FAC quadratic `math/kfac_predicted_kl` (both of the anchors' calibration prompts) and the measured held-out
    math kl_to_base, nats."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        if "math/kfac_predicted_kl" in row["metrics"]:
            arm = row["arm"]
            groups[f"{title(arm['optimizer'])} {row_label(arm, True)}"].append(row["metrics"])
    header = ["arm", "0.5 DtFD (diagonal)", "K-FAC prediction", "measured math KL"]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for label, group in groups.items():
        means = [
            statistics.fmean(0.5 * m["math/dtfd"] for m in group),
            statistics.fmean(m["math/kfac_predicted_kl"] for m in group),
            statistics.fmean(m["math/kl"] for m in group),
        ]
        lines.append(f"| {label} | " + " | ".join(format(v, ".3g") for v in means) + " |")
    return "\n".join(lines)


def frontier_panels(rows: list[dict], plan: Plan) -> list[tuple[str, dict, str]]:
    """(optimizer, curves, title) of every panel, from the first seed: each optimizer's methods (anchors None and
    math: unregularized, KL, CFP, CFP-KFAC, step-only, isotropic), the diagonal math anchors of other quality
    (SFT), and the K-FAC rank and size sweeps (SFT, DPO) beside the diagonal CFP [math]."""
    seed = {plan.seeds[0]}
    panels = [
        (o, frontier_points(rows, o, (None, "math"), seed), f"{title(o)}: methods (seed {plan.seeds[0]})")
        for o in (*plan.optimizers, *plan.rl_optimizers())
    ]
    quality = {None, "math", *plan.quality_anchors()}
    curves = frontier_points(rows, "sft", quality, seed)
    curves = {label: c for label, c in curves.items() if label.startswith(("CFP [", "isotropic"))}
    panels.append(("sft", curves, "SFT: diagonal math anchors of other sizes / estimator"))
    kfac = {None, *rank_labels(plan), *size_labels(plan)}
    for optimizer in plan.optimizers:
        curves = frontier_points(rows, optimizer, kfac, seed)
        curves = {label: c for label, c in curves.items() if label == "CFP [math]" or label.startswith("CFP-KFAC")}
        panels.append((optimizer, curves, f"{title(optimizer)}: K-FAC rank and anchor size"))
    sweep = truncation_labels(plan)
    for optimizer in plan.optimizers if len(sweep) > 1 else ():
        curves = frontier_points(rows, optimizer, {None, *sweep}, seed)
        curves = {f"CFP-KFAC [{a}]": curves[f"CFP-KFAC [{a}]"] for a in sweep if f"CFP-KFAC [{a}]" in curves}
        panels.append((optimizer, curves, f"{title(optimizer)}: K-FAC rank and tail (zero tails dashed)"))
    return panels


def unregularized_point(rows: list[dict], optimizer: str, seed: int) -> tuple[float, float] | None:
    """(math kl, task progress) of the unregularized run of `optimizer` on `seed`, where every curve starts."""
    for row in rows:
        arm = row.get("arm") or {}
        if arm.get("optimizer") == optimizer and arm["method"] == "unregularized" and arm["seed"] == seed:
            return row["metrics"]["math/kl"], row["metrics"][TASK_PROGRESS[optimizer]]
    return None


def plot_frontiers(rows: list[dict], plan: Plan, path: Path) -> None:
    """`frontier_panels` in a grid of four columns, task progress against held-out math KL."""
    import matplotlib  # optional (the `demo` extra): only `--plot` needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after choosing the Agg backend: no display needed

    panels = frontier_panels(rows, plan)
    columns = min(4, len(panels))
    lines = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(lines, columns, figsize=(5.2 * columns, 4.2 * lines), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    for ax, (optimizer, curves, name) in zip(axes.flat, panels, strict=False):
        palette = plt.get_cmap("tab20") if len(curves) > 10 else None  # the default cycle repeats after 10
        for i, (label, points) in enumerate(curves.items()):
            style = "--" if ZERO_TAIL.search(label) else "-"
            color = palette(i) if palette else None
            xs, ys = [p[0] for p in points], [p[1] for p in points]
            ax.plot(xs, ys, style, color=color, marker="o", markersize=4, label=label)
        start = unregularized_point(rows, optimizer, plan.seeds[0])
        if start is not None:
            ax.plot(*start, marker="*", markersize=11, color="black", linestyle="none", label="unregularized")
        ax.set_xlabel("math kl_to_base (nats, held-out prompts)  →  capability lost")
        ax.set_ylabel(f"{TASK_PROGRESS[optimizer]}  →  task learned")
        ax.set_title(name, fontsize=10)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle("Frontier: task progress vs capability KL; each curve from the unregularized run, stronger → left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _ran(rows: list[dict], optimizer: str) -> bool:
    return any(r.get("arm", {}).get("optimizer") == optimizer for r in rows)


RANK_TAIL_LEGEND = (
    "Each factor of every weight keeps its top r eigenpairs (rank r) or the fewest holding a share of its trace, the "
    "rest free (zero tail) or at their mean (mean tail); lam = c / p99 of the full anchor. Math KL ± its standard "
    "error on the held-out prompts; floats/param: what the K-FAC bases store per factored parameter. The last two "
    "columns: the truncation's math KL interpolated (linear in log KL between consecutive strengths) at full rank's "
    f"task progress at c = 1, and its ratio to full rank's math KL there; n/a: its strengths do not reach that "
    f"progress (no extrapolation); {MISSING}: not run yet."
)


def markdown_report(rows: list[dict], plan: Plan) -> str:
    """Both tables for every optimizer that ran (SFT, DPO, each RL reward), every SFT arm, the K-FAC sweeps, the
    rank and tail sweep with its rule, and the predicted against measured math KL, as one markdown document."""
    parts = []
    for optimizer in [o for o in (*plan.optimizers, *plan.rl_optimizers()) if _ran(rows, o)]:
        parts += [
            f"### {title(optimizer)}: quadratic sensitive drift vs the unregularized run",
            drift_table(rows, optimizer, plan.is_table_row),
            f"### {title(optimizer)}: task progress and held-out capability",
            capability_table(rows, optimizer, plan.is_table_row),
        ]
    if "sft" in plan.optimizers and _ran(rows, "sft"):
        parts += [
            "### SFT: every arm (all strengths, quality anchors)",
            drift_table(rows, "sft", lambda arm: True, True),
        ]
    seed, c = plan.seeds[0], plan.table_strength
    for name, labels in (("rank", rank_labels(plan)), ("anchor size", size_labels(plan))):
        for optimizer in [o for o in plan.optimizers if plan.kfac_strengths and _ran(rows, o)]:
            parts += [
                f"### {title(optimizer)}: CFP-KFAC [math] by {name} (c = {c:g}, seed {seed})",
                sweep_table(rows, optimizer, labels, c, seed),
            ]
    swept = [o for o in plan.optimizers if len(truncation_labels(plan)) > 1 and plan.kfac_strengths and _ran(rows, o)]
    for optimizer in swept:
        parts.append(f"### Rank and tail sweep: {title(optimizer)} (CFP-KFAC [math], seed {seed})")
        parts += [RANK_TAIL_LEGEND] if optimizer == swept[0] else []
        parts.append(rank_tail_table(rows, plan, optimizer))
    if swept:
        parts.append(rank_tail_rule(rows, plan))
    if any("math/kfac_predicted_kl" in r["metrics"] for r in rows):
        parts += ["### Predicted against measured math KL (nats)", prediction_table(rows)]
    return "\n\n".join(parts) + "\n"
