"""What is left of an evidence run and about how long it will take, without loading a model
(`reproduce_table.py --list`).

An arm still to run costs the median `seconds` of the finished rows of its kind (`kind`: optimizer, method, a
full-rank K-FAC anchor or not, greedy scores or not); with none, a prior: the median of the optimizer's finished
plain arms (no K-FAC anchor, no greedy scores), else `Costs.arm` (SFT, DPO) or `Costs.rl_arm` (RLOO), plus

    steps x kfac_step (full-rank K-FAC protection) or steps x kfac_truncated_step (truncated),
    kfac_anchor per full-rank K-FAC anchor it binds (reading it, binding, its metrics at the last step),
    greedy (the greedy scores, `Plan.measures_greedy`).

An anchor still to make (`AnchorStore.missing`) costs `sequences x anchor_sequence`, plus `kfac_decomposition`
for a K-FAC one; a pooled K-FAC anchor `kfac_decomposition` per pairwise mean it computes (its planned halves
are listed on their own); a pooled diagonal one nothing. `references` is the start of every run (the model, the
base model's held-out responses and rewards).
"""

import statistics
from dataclasses import dataclass
from pathlib import Path

from .anchors import AnchorStore
from .plan import Arm, Plan, is_new, kfac_anchor_name, rl_reward


@dataclass(frozen=True)
class Costs:
    """Prior seconds on 2 CPU cores (measured rows replace the arm priors, see the module docstring)."""

    arm: float  # an SFT or DPO arm, no K-FAC anchor, no greedy scores: 8 steps and the capability probe
    rl_arm: float  # an RLOO arm likewise (8 steps of sampling and scoring, the probe, the sampled rewards)
    kfac_step: float  # one full-rank K-FAC correction
    kfac_truncated_step: float  # one correction with a truncated basis (rank 64)
    kfac_anchor: float  # reading, binding and measuring (once) one full-rank K-FAC anchor in an arm
    greedy: float  # the greedy scores of an arm
    anchor_sequence: float  # one calibration sequence of an estimate (diagonal or K-FAC)
    kfac_decomposition: float  # the eigendecompositions of one K-FAC anchor (estimated or pooled)
    references: float  # loading the model, the base model's responses, log-probs and rewards


# The embedded SmolLM2-135M on these 2 cores. Arms: the committed first run's plain arms took 90-140 s on a shared
# machine (a median of about 105 s without greedy scores, which added about 45 s); on a quieter one (2026-12-01) a
# full-rank CFP-KFAC SFT arm with greedy scores took 108 s, a rank-64 DPO arm 59 s and a CFP-KFAC RLOO arm 107 s.
# Anchors (the same day): a 32-sequence diagonal estimate 62-89 s, a K-FAC one 88 s with its eigendecompositions.
# The K-FAC step and binding costs are those measured for the 135M model when the K-FAC anchors were merged.
EMBEDDED_COSTS = Costs(
    arm=105.0,
    rl_arm=110.0,
    kfac_step=3.5,
    kfac_truncated_step=0.2,
    kfac_anchor=5.0,
    greedy=45.0,
    anchor_sequence=2.5,
    kfac_decomposition=30.0,
    references=120.0,
)
TINY_COSTS = Costs(1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.05, 0.1, 10.0)


def kind(arm: Arm, plan: Plan) -> tuple:
    """What an arm's cost depends on: (optimizer, method, protected by a full-rank K-FAC anchor, greedy)."""
    full = arm.method == "kfac" and not is_truncated(kfac_anchor_name(str(arm.anchor)))
    return arm.optimizer, arm.method, full, plan.measures_greedy(arm)


def is_truncated(name: str) -> bool:
    """A truncated K-FAC anchor (`math_kfac_r8`): views of the full anchor's bases, nothing more to read."""
    return "_kfac_r" in name


def arm_prior(arm: Arm, plan: Plan, costs: Costs, plain: list[float]) -> float:
    """The prior seconds of `arm` (module docstring); `plain`: the seconds of the optimizer's finished plain arms."""
    seconds = statistics.median(plain) if plain else costs.rl_arm if rl_reward(arm.optimizer) else costs.arm
    full = [n for n in plan.anchors_of(arm) if "_kfac" in n and not is_truncated(n)]
    seconds += costs.kfac_anchor * len(full) + (costs.greedy if plan.measures_greedy(arm) else 0.0)
    if arm.method == "kfac":
        truncated = is_truncated(kfac_anchor_name(str(arm.anchor)))
        seconds += plan.steps * (costs.kfac_truncated_step if truncated else costs.kfac_step)
    return seconds


def arm_seconds(plan: Plan, done: dict[str, dict], costs: Costs) -> dict[str, float]:
    """{key: estimated seconds} of every arm of `plan` not in `done` (results rows by key)."""
    measured: dict[tuple, list[float]] = {}
    plain: dict[str, list[float]] = {}
    for row in done.values():
        if "arm" not in row or "seconds" not in row:
            continue
        arm = Arm(**row["arm"])
        measured.setdefault(kind(arm, plan), []).append(row["seconds"])
        if not is_new(arm) and not plan.measures_greedy(arm):
            plain.setdefault(arm.optimizer, []).append(row["seconds"])
    return {
        arm.key: statistics.median(measured[kind(arm, plan)])
        if kind(arm, plan) in measured
        else arm_prior(arm, plan, costs, plain.get(arm.optimizer, []))
        for arm in plan.arms()
        if arm.key not in done
    }


def anchor_seconds(store: AnchorStore, names: set[str], costs: Costs) -> dict[str, float]:
    """{name: estimated seconds} of every anchor still to make for `names` (`AnchorStore.missing`)."""
    estimates = {}
    for name in store.missing(names):
        spec = store.specs[name]
        kfac = spec.structure == "kfac"
        if spec.kind == "estimated":
            estimates[name] = spec.sequences * costs.anchor_sequence + (costs.kfac_decomposition if kfac else 0.0)
        else:  # pooled: a pairwise tree of K parts computes K - 1 means, less those of its planned halves
            halves = sum(1 for s in store.specs.values() if s.kind == "pooled" and set(s.parts) < set(spec.parts))
            estimates[name] = costs.kfac_decomposition * (len(spec.parts) - 1 - halves) if kfac else 0.0
    return estimates


def remaining(plan: Plan, output_dir: Path, done: dict[str, dict], costs: Costs) -> str:
    """The arms and anchors still to make for `output_dir` with their estimated seconds, and the total."""
    arms = arm_seconds(plan, done, costs)
    todo = [arm for arm in plan.arms() if arm.key in arms]
    store = AnchorStore(None, None, plan, output_dir / "anchors")
    anchors = anchor_seconds(store, {n for arm in todo for n in plan.anchors_of(arm)}, costs)
    start = costs.references if todo else 0.0
    lines = [f"{len(todo)} arms to run in {output_dir} ({len(done) - ('base' in done)} done):"]
    lines += [f"  {key:<44} ~{seconds:5.0f} s" for key, seconds in arms.items()]
    lines += [f"{len(anchors)} anchors to make first:"] + [f"  {n:<44} ~{s:5.0f} s" for n, s in anchors.items()]
    total = start + sum(arms.values()) + sum(anchors.values())
    lines.append(f"references ~{start:.0f} s; total ~{total:.0f} s ({total / 3600:.1f} h)")
    return "\n".join(lines)
