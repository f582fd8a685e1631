"""Tables and plots of the long run, from its rows (`run.run_long`).

- Final table, per optimizer: one row per arm (method, strength), the task progress, each capability's held-out
  KL, math exact match and the refusal rate, each with its 95% interval (1.96 standard errors), the scored items,
  the optimizer steps and the training seconds per step; the base model first.
- Matched task progress, per optimizer: each method's KL of every capability at `MATCHED` shares of the
  unregularized run's task progress, interpolated linearly between consecutive points of its frontier (the base
  model at (0, 0) as the limit of infinite strength, then the points no other beats of its strengths' final points
  and its zero strength: the unregularized run, for LoRA + CFP-KFAC LoRA alone; WiSE-FT: its mixing weights; LoRA
  alone, which has no strength: its own point; early stopping: the unregularized run's measured points), ordered by
  task progress; "n/a" where its points do not reach that progress (never extrapolated). A value past every task
  progress the method's own arms reached, which rests on the line to its zero strength alone, is marked `BEYOND`.
  Per capability and target, the method with the least KL is named, with the next best and the best of the other
  kind (baseline or CFP), each as a ratio to the least.
- Seed by seed, per optimizer (`seeds_table`): every arm run on more than one seed, its final measures side by
  side.
- Along each run, per optimizer (`trajectory_table`): each trained arm's KL where its own measured curve reaches
  those shares, as if it had been stopped there (GRPO: shares of the unregularized run's last logged training
  reward gain over the base model's held-out reward).
- Plots (`plot_report`): per optimizer and capability the frontier (task progress against the capability's KL,
  one curve per method) and the curves over steps (math KL and task progress at every measured step, one line per
  arm; for GRPO the reward of the trainer's own samples as logged, less the base model's, `task_curve`); KL axes
  are linear below `LINEAR_BELOW` nats and logarithmic above.
"""

import math
from collections import Counter, defaultdict
from dataclasses import replace
from pathlib import Path

from .measure import BEHAVIOUR
from .plan import Plan, grpo_reward, summed_labels

# Shares of the unregularized run's task progress at which methods are compared; 20% because under DPO most
# methods stop well short of half the unregularized margin.
MATCHED = (0.2, 0.5, 0.8)
CAPABILITIES = ("math", "code", "safety")
LABELS = {
    "unregularized": "unregularized",
    "kl": "KL penalty",
    "lwf": "LwF distillation",
    "isotropic": "L2 to theta0 (isotropic)",
    "cfp": "CFP diagonal",
    "wiseft": "WiSE-FT",
    "lora": "LoRA",
}
EARLY_STOPPING = "early stopping"
# Marks a matched value past every task progress the method's own arms reached (`measured_reach`).
BEYOND = "†"
BEYOND_NOTE = (
    "past the task progress of every arm of the method: on the straight line to its zero strength (the unregularized"
    " run; for LoRA + CFP-KFAC, LoRA alone), across a stretch no arm of the method measured."
)
# The plots' KL axes are linear below this many nats and logarithmic above, so that a method within a tenth of a
# nat of the base and an unregularized run hundreds of nats away are both readable.
LINEAR_BELOW = 0.1
SYMLOG = f"symlog, linear to {LINEAR_BELOW:g}"
MISSING = "—"
LINE_STYLES = ("-", "--", ":")  # the first seed or strength of a method, the second, the rest


def task_key(optimizer: str, plan: Plan) -> str:
    """The metric of task progress: GRPO the reward gain; SFT and DPO the behavioural gain with `Plan.behaviour`
    (`measure.BEHAVIOUR`), else the held-out per-token gain (SFT) and the held-out margin (DPO)."""
    reward = grpo_reward(optimizer)
    if reward:
        return f"task/{reward}_gain"
    return f"{BEHAVIOUR}_gain" if plan.behaviour else {"sft": "task/sft_gain", "dpo": "task/dpo_margin"}[optimizer]


def method_label(arm: dict, plan: Plan) -> str:
    """'CFP-KFAC full rank', 'CFP-KFAC rank 256 + tail', 'LoRA + CFP-KFAC ...', or `LABELS`."""
    anchor = arm.get("anchor") or ""
    domain, _, variant = anchor.partition("_")
    kfac = "CFP-KFAC full rank" if anchor == "math" else f"CFP-KFAC {variant}"
    if arm["method"] == "kfac_summed":
        return f"{kfac}, {' + '.join(label.partition('_')[0] for label in summed_labels(anchor))} summed"
    if domain not in ("", "math"):
        kfac += f", one {domain} anchor"
    if arm["method"] == "kfac":
        return kfac
    if arm["method"] == "lora_kfac":
        return f"LoRA + {kfac}"
    return LABELS[arm["method"]]


def _interval(metrics: dict, key: str, spec: str = ".3g") -> str:
    value = metrics.get(key)
    if value is None:
        return MISSING
    stderr = metrics.get(f"{key}_stderr")
    if stderr is None or math.isnan(stderr):
        return f"{value:{spec}}"
    return f"{value:{spec}} ± {1.96 * stderr:{spec}}"


def _refusal_rate(metrics: dict) -> str:
    return f"{metrics['safety/refusal_rate']:.2f}" if "safety/refusal_rate" in metrics else MISSING


def _rows_of(rows: list[dict], optimizer: str) -> list[dict]:
    return [r for r in rows if r["key"] != "base" and r["arm"]["optimizer"] == optimizer]


def final_table(rows: list[dict], plan: Plan, optimizer: str) -> str:
    """The final table of one optimizer (module docstring)."""
    task = task_key(optimizer, plan)
    header = (
        f"| arm | strength | seed | steps | {task} | math KL | code KL | safety KL | math exact match | refusal rate "
        "| s/step |\n|---|---|---|---|---|---|---|---|---|---|---|"
    )
    base = next((r for r in rows if r["key"] == "base"), None)
    lines = [header]
    for row in ([base] if base else []) + _rows_of(rows, optimizer):
        m = row["metrics"]
        label = "base model" if row["key"] == "base" else method_label(row["arm"], plan)
        strength, seed = ("", "") if row["key"] == "base" else (f"{row['arm']['strength']:g}", str(row["arm"]["seed"]))
        seconds = m.get("seconds_per_step")
        cells = [
            label,
            strength,
            seed,
            str(row.get("steps", "")),
            _interval(m, task) if task in m else MISSING,
            *(_interval(m, f"{d}/kl") for d in ("math", "code", "safety")),
            _interval(m, "math/exact_match", ".2f") + f" (n={m.get('math/items', '?')})",
            _refusal_rate(m),
            f"{seconds:.2f}" if seconds else MISSING,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_path(row: dict, optimizer: str, kl: str, plan: Plan) -> list[tuple[float, float]]:
    """(task progress, KL) along a run, ordered by progress: the base model at step 0, (0, 0), then every measured
    point of its curve, its progress as `task_curve` reads it at that step (GRPO: the logged training reward less
    the base's)."""
    progress = dict(task_curve(row, optimizer, plan))
    return sorted([(0.0, 0.0), *((progress[p["step"]], p[kl]) for p in row.get("curve", []) if p["step"] in progress)])


def lower_envelope(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point beats, ordered by task progress: a point is dropped when another has at least its
    progress at no more KL (the frontier a user can reach by picking a strength)."""
    kept: list[tuple[float, float]] = []
    for progress, kl in sorted(points, key=lambda p: (-p[0], p[1])):
        if not kept or kl < kept[-1][1]:
            kept.append((progress, kl))
    return kept[::-1]


def frontiers(
    rows: list[dict], plan: Plan, optimizer: str, seed: int, capability: str = "math"
) -> dict[str, list[tuple[float, float]]]:
    """{method label: [(task progress, the capability's KL)] ordered by task progress}: the base model at (0, 0)
    (infinite strength), then the `lower_envelope` of its strengths' final points and its zero strength (the
    unregularized run; for LoRA + CFP-KFAC, LoRA alone; LoRA alone, which has no strength, is its own point only);
    and `EARLY_STOPPING`: the unregularized run's own measured points (KL on the first response of each prompt) from
    the base model at (0, 0), where its curve measures the task (SFT and DPO; GRPO's curve logs the training reward
    instead)."""
    kl = f"{capability}/kl"
    task = task_key(optimizer, plan)
    own = [r for r in _rows_of(rows, optimizer) if r["arm"]["seed"] == seed and task in r["metrics"]]
    unregularized = [r for r in own if r["arm"]["method"] == "unregularized"]
    curves: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for row in own:
        if row["arm"]["method"] == "unregularized":
            continue
        curves[method_label(row["arm"], plan)].append((row["metrics"][task], row["metrics"][kl]))
    lora = curves.get(LABELS["lora"], [])[:1]
    unregularized_end = [(r["metrics"][task], r["metrics"][kl]) for r in unregularized[:1]]
    for label, points in curves.items():
        if label != LABELS["lora"]:
            curves[label] = [
                (0.0, 0.0),
                *lower_envelope([*points, *(lora if label.startswith("LoRA") else unregularized_end)]),
            ]
    stopped = run_path(unregularized[0], optimizer, kl, plan) if unregularized and not grpo_reward(optimizer) else []
    if len(stopped) > 1:
        curves[EARLY_STOPPING] = stopped
    return dict(curves)


def kl_at(points: list[tuple[float, float]], progress: float) -> float | None:
    """The math KL at `progress`, linear between the two consecutive points that bracket it; None when none do."""
    for (g0, k0), (g1, k1) in zip(points, points[1:], strict=False):
        if g0 <= progress <= g1:
            return k0 if g1 == g0 else k0 + (k1 - k0) * (progress - g0) / (g1 - g0)
    return None


def least_kl_line(found: list[tuple[float, str]]) -> str:
    """'least KL A (a); next B (b, b/a x); best baseline C (c, c/a x)' from (KL, method) pairs sorted by KL: the
    runner-up, and the best method of the other kind (a baseline when a CFP method is least, else the best CFP
    method) unless it is the runner-up. A ratio only where the least KL is above zero."""

    def ratio(value: float) -> str:
        return f", {value / best:{'.1f' if value < 10 * best else '.0f'}}x" if best > 0 else ""

    (best, first), (runner_up, second) = found[:2]
    line = f"least KL {first} ({best:.3g}); next {second} ({runner_up:.3g}{ratio(runner_up)})"
    other = [(v, label) for v, label in found[1:] if ("CFP" in label) != ("CFP" in first)]
    if other and other[0][1] != second:
        kind = "baseline" if "CFP" in first else "CFP method"
        line += f"; best {kind} {other[0][1]} ({other[0][0]:.3g}{ratio(other[0][0])})"
    return line if best > 0 else line + " (the least is at or below zero: no ratio)"


def measured_reach(rows: list[dict], plan: Plan, optimizer: str, seed: int) -> dict[str, float]:
    """{method label: the most task progress any of its own arms reached on `seed`}. A matched value beyond it rests
    on the frontier's straight line to the method's zero strength (the unregularized run; for LoRA + CFP-KFAC, LoRA
    alone), across a stretch no arm of the method measured."""
    task = task_key(optimizer, plan)
    reach: dict[str, float] = {}
    for row in _rows_of(rows, optimizer):
        if row["arm"]["seed"] == seed and row["arm"]["method"] != "unregularized" and task in row["metrics"]:
            label = method_label(row["arm"], plan)
            reach[label] = max(reach.get(label, -math.inf), row["metrics"][task])
    return reach


def matched_table(rows: list[dict], plan: Plan, optimizer: str, seed: int) -> str:
    """Each method's KL of every capability at the `MATCHED` shares of the unregularized run's task progress
    (module docstring), `BEYOND`-marked past its `measured_reach`, and per capability and share the method with the
    least KL and how it compares (`least_kl_line`)."""
    task = task_key(optimizer, plan)
    unregularized = [
        r for r in _rows_of(rows, optimizer) if r["arm"]["method"] == "unregularized" and r["arm"]["seed"] == seed
    ]
    if not unregularized:
        return f"(no unregularized {optimizer} run yet)"
    full = unregularized[0]["metrics"][task]
    targets = [share * full for share in MATCHED]
    curves = {d: frontiers(rows, plan, optimizer, seed, d) for d in CAPABILITIES}
    reach = measured_reach(rows, plan, optimizer, seed)

    def mark(label: str, target: float) -> str:
        return BEYOND if target > reach.get(label, math.inf) else ""

    heads = [
        f"{d} KL at {share:.0%} ({t:.3g})" for d in CAPABILITIES for share, t in zip(MATCHED, targets, strict=True)
    ]
    lines = ["| method | " + " | ".join(heads) + " |", "|---|" + "---|" * len(heads)]
    for label in curves["math"]:
        values = [(kl_at(curves[d][label], t), t) for d in CAPABILITIES for t in targets]
        shown = [f"{v:.3g}{mark(label, t)}" if v is not None else "n/a" for v, t in values]
        lines.append(f"| {label} | " + " | ".join(shown) + " |")
    lines += ["", f"{BEYOND} {BEYOND_NOTE}", ""] if any(BEYOND in line for line in lines[2:]) else [""]
    for d in CAPABILITIES:
        for share, target in zip(MATCHED, targets, strict=True):
            found = sorted(
                (v, label + mark(label, target))
                for label, pts in curves[d].items()
                if (v := kl_at(pts, target)) is not None
            )
            if len(found) >= 2:
                lines.append(f"- {d} at {share:.0%}: " + least_kl_line(found))
    return "\n".join(lines)


def trajectory_table(rows: list[dict], plan: Plan, optimizer: str, seed: int) -> str:
    """Each trained arm's KL of every capability at the step where its own curve reaches the `MATCHED` shares of
    the unregularized run's final task progress: linear between its measured points, from the base model at step 0
    (0, 0); "n/a" where the arm never reaches that progress. Progress as `task_curve` reads it: under GRPO the
    logged training reward less the base's, its targets shares of the unregularized run's last such gain (the
    held-out reward is measured at the end only). The unregularized run's own row is the matched table's early
    stopping."""
    own = [r for r in _rows_of(rows, optimizer) if r["arm"]["seed"] == seed and r.get("curve")]
    unregularized = [r for r in own if r["arm"]["method"] == "unregularized"]
    if not unregularized:
        return ""
    reference = unregularized[0]
    full = (
        task_curve(reference, optimizer, plan)[-1][1]
        if grpo_reward(optimizer)
        else reference["metrics"][task_key(optimizer, plan)]
    )
    targets = [share * full for share in MATCHED]
    heads = [
        f"{d} KL at {share:.0%} ({t:.3g})" for d in CAPABILITIES for share, t in zip(MATCHED, targets, strict=True)
    ]
    lines = ["| arm | strength | " + " | ".join(heads) + " |", "|---|---|" + "---|" * len(heads)]
    for row in own:
        if row["arm"]["method"] == "unregularized":
            continue
        values = [kl_at(run_path(row, optimizer, f"{d}/kl", plan), t) for d in CAPABILITIES for t in targets]
        cells = [method_label(row["arm"], plan), f"{row['arm']['strength']:g}"]
        cells += [f"{v:.3g}" if v is not None else "n/a" for v in values]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def seeds_table(rows: list[dict], plan: Plan, optimizer: str) -> str:
    """Every arm (method, strength) run on more than one seed, its final measures side by side, seed by seed
    ("a / b", each with its 95% interval where it has one): how far a second seed moves each number. Empty where no
    arm has two seeds."""
    task = task_key(optimizer, plan)
    measures = [(task, ".3g"), ("math/kl", ".3g"), ("safety/kl", ".3g"), ("math/exact_match", ".2f")]
    by_arm: dict[tuple[str, float], dict[int, dict]] = defaultdict(dict)
    for row in _rows_of(rows, optimizer):
        arm = row["arm"]
        by_arm[(method_label(arm, plan), arm["strength"])][arm["seed"]] = row["metrics"]
    lines = []
    for (label, strength), seeds in by_arm.items():
        if len(seeds) < 2:
            continue
        order = sorted(seeds)
        cells = [" / ".join(_interval(seeds[s], key, spec) for s in order) for key, spec in measures]
        refusals = " / ".join(_refusal_rate(seeds[s]) for s in order)
        seed_names = "/".join(str(s) for s in order)
        lines.append(f"| {label} | {strength:g} | {seed_names} | " + " | ".join([*cells, refusals]) + " |")
    if not lines:
        return ""
    header = f"| arm | strength | seeds | {task} | math KL | safety KL | math exact match | refusal rate |"
    return "\n".join([header, "|---|---|---|---|---|---|---|---|", *lines])


def compared_seeds(rows: list[dict], optimizer: str) -> list[int]:
    """The seeds of `optimizer` with an arm beside the unregularized run (more than one row), in order."""
    arms_per_seed = Counter(r["arm"]["seed"] for r in _rows_of(rows, optimizer))
    return sorted(seed for seed, arms in arms_per_seed.items() if arms > 1)


def markdown_report(rows: list[dict], plan: Plan) -> str:
    """Every table, per optimizer that has rows: the final table, the arms run on several seeds side by side
    (`seeds_table`), then the matched comparisons of each seed with
    an arm beside its unregularized run. With `Plan.behaviour`, SFT and DPO judged on behaviour first, then on
    the held-out log-likelihood measures (`proxy_view`) as a second view."""
    parts = ["# Long run", ""]
    views = [(plan, "")]
    if plan.behaviour:
        views = [(plan, " (task judged on behaviour)"), (proxy_view(plan), " (task on the held-out log-likelihoods)")]
    for view, title in views:
        for optimizer in plan.optimizers:
            own = _rows_of(rows, optimizer)
            if not own or (view is not plan and grpo_reward(optimizer)):
                continue
            parts += [f"## {optimizer.upper()}{title}", "", final_table(rows, view, optimizer), ""]
            side_by_side = seeds_table(rows, view, optimizer)
            if side_by_side:
                parts += ["### Seed by seed", "", side_by_side, ""]
            for seed in compared_seeds(rows, optimizer):
                matched = matched_table(rows, view, optimizer, seed)
                parts += [f"### At matched task progress (seed {seed})", "", matched, ""]
                along = trajectory_table(rows, view, optimizer, seed)
                if along:
                    parts += [f"### At matched task progress along each run (seed {seed})", "", along, ""]
    return "\n".join(parts)


def proxy_view(plan: Plan) -> Plan:
    """`plan` with SFT and DPO progress read on the held-out log-likelihood measures instead of behaviour."""
    return replace(plan, behaviour=False)


def task_curve(row: dict, optimizer: str, plan: Plan) -> list[tuple[int, float]]:
    """(step, task progress) along a run: the held-out measure of SFT and DPO at each measured step; for GRPO the
    mean reward of the trainer's own samples, as TRL logs it at each logging step (the held-out reward is measured
    at the end only), minus the base model's held-out reward r0 = `task/<reward>_reward - task/<reward>_gain`, so
    that progress starts at 0 as SFT's and DPO's does (the brevity reward's r0 is about -1, not 0)."""
    if reward := grpo_reward(optimizer):
        metrics = row["metrics"]
        base = metrics[f"task/{reward}_reward"] - metrics[f"task/{reward}_gain"]
        return [(entry["step"], entry["reward"] - base) for entry in row.get("history", []) if "reward" in entry]
    key = task_key(optimizer, plan)
    return [(point["step"], point[key]) for point in row.get("curve", []) if key in point]


def strength_rank(arm: dict, plan: Plan) -> int:
    """The place of an arm's strength in its method's sweep (`Plan.sweeps`): 0 for the first strength and for the
    methods without one (unregularized, WiSE-FT, LoRA alone), 1 for the second."""
    for method, anchor, strengths in plan.sweeps(arm["optimizer"]):
        if (method, anchor) == (arm["method"], arm.get("anchor")) and arm["strength"] in strengths:
            return strengths.index(arm["strength"])
    return 0


def method_colours(labels: list[str]) -> dict[str, str]:
    """One colour per method label in first-seen order, so that a method keeps its colour in every panel."""
    palette = [f"C{i}" for i in range(10)] + ["black", "dimgray", "olive"]
    return {label: palette[i % len(palette)] for i, label in enumerate(dict.fromkeys(labels))}


def plot_report(rows: list[dict], plan: Plan, out: Path, suffix: str = "") -> list[Path]:
    """`frontier.png` (per optimizer and capability: task progress against its KL, one curve per method and seed,
    the first seed solid, the second dashed) and `curves.png` (per optimizer and seed: math KL and task progress at
    every measured step of its arms, a method's first strength solid and its second dashed); a method has one
    colour in both. Only seeds with an arm beside the unregularized run are drawn; `suffix` ends the file names
    (`frontier<suffix>.png`). Returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = {o: compared_seeds(rows, o) for o in plan.optimizers if compared_seeds(rows, o)}
    if not seeds:
        return []
    drawn = {(o, s, c): frontiers(rows, plan, o, s, c) for o, own in seeds.items() for s in own for c in CAPABILITIES}
    labels = [label for curves in drawn.values() for label in curves]
    colours = method_colours([*labels, *(method_label(r["arm"], plan) for r in rows if "arm" in r)])
    paths = [out / f"frontier{suffix}.png", out / f"curves{suffix}.png"]
    figure, axes = plt.subplots(3, len(seeds), figsize=(5 * len(seeds), 12), squeeze=False, layout="constrained")
    for column, (optimizer, own) in enumerate(seeds.items()):
        for axis, capability in zip(axes[:, column], CAPABILITIES, strict=True):
            for rank, seed in enumerate(own):
                for label, points in drawn[optimizer, seed, capability].items():
                    xy = ([k for _, k in points], [g for g, _ in points])
                    style = {"linestyle": LINE_STYLES[min(rank, 2)], "marker": "o" if rank == 0 else "x"}
                    axis.plot(*xy, label=label, color=colours[label], **style)
            axis.set(xlabel=f"held-out {capability} KL (nats, {SYMLOG})", ylabel=task_key(optimizer, plan))
            axis.set_title(f"{optimizer.upper()}, seed{'s' * (len(own) > 1)} {', '.join(map(str, own))}")
            axis.set_xscale("symlog", linthresh=LINEAR_BELOW)
    legend = "solid: first seed, dashed: second"
    figure.legend(*_unique_handles(axes), loc="outside lower center", ncols=6, fontsize=8, title=legend)
    figure.savefig(paths[0], dpi=120)
    _plot_curves(rows, plan, [(o, s) for o, own in seeds.items() for s in own], colours).savefig(paths[1], dpi=120)
    plt.close("all")
    return paths


def _plot_curves(rows: list[dict], plan: Plan, panels: list[tuple[str, int]], colours: dict[str, str]):
    """The `curves.png` figure of `plot_report`: one column per (optimizer, seed) in `panels`, the arms of that
    seed."""
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, len(panels), figsize=(5 * len(panels), 7), squeeze=False, layout="constrained")
    for column, (optimizer, seed) in enumerate(panels):
        for row in _rows_of(rows, optimizer):
            if not row.get("curve") or row["arm"]["seed"] != seed:
                continue
            label = method_label(row["arm"], plan)
            style = {"color": colours[label], "linestyle": LINE_STYLES[min(strength_rank(row["arm"], plan), 2)]}
            steps = [p["step"] for p in row["curve"]]
            axes[0][column].plot(steps, [p["math/kl"] for p in row["curve"]], label=label, **style)
            axes[1][column].plot(*zip(*task_curve(row, optimizer, plan), strict=True), label=label, **style)
        axes[0][column].set(title=f"{optimizer.upper()}, seed {seed}", ylabel=f"held-out math KL\n(nats, {SYMLOG})")
        axes[0][column].set_yscale("symlog", linthresh=LINEAR_BELOW)
        progress = (
            "training reward - base model's\n(logged mean)" if grpo_reward(optimizer) else "held-out task progress"
        )
        axes[1][column].set(xlabel="optimizer step", ylabel=progress)
    legend = "solid: first strength, dashed: second"
    figure.legend(*_unique_handles(axes), loc="outside lower center", ncols=6, fontsize=8, title=legend)
    return figure


def _unique_handles(axes) -> tuple[list, list[str]]:
    """The legend entries of every panel, one per label."""
    entries = {
        label: handle for axis in axes.flat for handle, label in zip(*axis.get_legend_handles_labels(), strict=True)
    }
    return list(entries.values()), list(entries)
