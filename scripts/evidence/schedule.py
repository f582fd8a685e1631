"""What is left of an evidence run and about how long it will take, without loading a model
(`reproduce_table.py --list`).

An arm still to run costs the median `seconds` of the finished rows of its kind (`kind`: optimizer, method, its
K-FAC protection: full rank, truncated with a zero tail or with a mean tail, or none; greedy scores or not). A
mean-tail arm with no finished row of its kind costs the median of the finished zero-tail rows of its optimizer
(same greedy) plus steps x (kfac_tailed_step - kfac_truncated_step): the same arm with a costlier correction.
Otherwise a prior: the median of the optimizer's finished plain arms (no K-FAC anchor, no greedy scores), else
`Costs.arm` (SFT, DPO) or `Costs.rl_arm` (RLOO), plus

    steps x kfac_step (full-rank K-FAC protection), steps x kfac_truncated_step (truncated, zero tail) or
        steps x kfac_tailed_step (truncated, mean tail),
    kfac_anchor per full-rank K-FAC anchor it binds (reading it, binding, its metrics at the last step),
    greedy (the greedy scores, `Plan.measures_greedy`).

A truncation's step cost does not depend on its rank here (a correction is O(out in r)); the measured medians of a
kind mix the ranks of the rows that ran.

An anchor still to make (`AnchorStore.missing`) costs `sequences x anchor_sequence`, plus `kfac_decomposition`
for a K-FAC one; a pooled K-FAC anchor `kfac_decomposition` per pairwise mean it computes (its planned halves
are listed on their own); a pooled diagonal one nothing. `references` is the start of every run (the model, the
base model's held-out responses and rewards).
"""

import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from .anchors import AnchorStore
from .plan import TRUNCATION_TAILS, Arm, Plan, is_new, rl_reward, truncation


@dataclass(frozen=True)
class Costs:
    """Prior seconds on 2 CPU cores (measured rows replace the arm priors, see the module docstring)."""

    arm: float  # an SFT or DPO arm, no K-FAC anchor, no greedy scores: 8 steps and the capability probe
    rl_arm: float  # an RLOO arm likewise (8 steps of sampling and scoring, the probe, the sampled rewards)
    kfac_step: float  # one full-rank K-FAC correction
    kfac_truncated_step: float  # one correction with a truncated basis, zero tail (rank 64): 2 matmuls out x in x r
    kfac_anchor: float  # reading, binding and measuring (once) one full-rank K-FAC anchor in an arm
    greedy: float  # the greedy scores of an arm
    anchor_sequence: float  # one calibration sequence of an estimate (diagonal or K-FAC)
    kfac_decomposition: float  # the eigendecompositions of one K-FAC anchor (estimated or pooled)
    references: float  # loading the model, the base model's responses, log-probs and rewards

    @property
    def kfac_tailed_step(self) -> float:
        """One correction with a mean tail (rank 64): the four-block map, about 4 matmuls out x in x r against 2
        (`hf_cfp.geometry.kronecker.basis`), so twice `kfac_truncated_step` (a prior, until such rows ran)."""
        return 2 * self.kfac_truncated_step


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


def protection(arm: Arm) -> str | None:
    """An arm's K-FAC protection: "full" (rank), "zero" or "mean" (a truncation and its tail), None (not K-FAC)."""
    if arm.method != "kfac":
        return None
    cut = truncation(str(arm.anchor))
    return TRUNCATION_TAILS[cut[1]] if cut else "full"


def kind(arm: Arm, plan: Plan) -> tuple:
    """What an arm's cost depends on: (optimizer, method, its K-FAC protection (`protection`), greedy)."""
    return arm.optimizer, arm.method, protection(arm), plan.measures_greedy(arm)


def is_truncated(name: str) -> bool:
    """A truncated K-FAC anchor (`math_kfac_r8`, `math_kfac_t64`, `code_kfac_s90`): derived from the full anchor
    when loaded, nothing more to read."""
    return re.search(r"_kfac_[rts][0-9]+$", name) is not None


def arm_prior(arm: Arm, plan: Plan, costs: Costs, plain: list[float]) -> float:
    """The prior seconds of `arm` (module docstring); `plain`: the seconds of the optimizer's finished plain arms."""
    seconds = statistics.median(plain) if plain else costs.rl_arm if rl_reward(arm.optimizer) else costs.arm
    full = [n for n in plan.anchors_of(arm) if "_kfac" in n and not is_truncated(n)]
    seconds += costs.kfac_anchor * len(full) + (costs.greedy if plan.measures_greedy(arm) else 0.0)
    step = {"full": costs.kfac_step, "zero": costs.kfac_truncated_step, "mean": costs.kfac_tailed_step}
    return seconds + plan.steps * step.get(protection(arm) or "", 0.0)


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
    extra = plan.steps * (costs.kfac_tailed_step - costs.kfac_truncated_step)  # a mean tail over a zero one
    seconds = {}
    for arm in plan.arms():
        if arm.key in done:
            continue
        optimizer, method, protected, greedy = mine = kind(arm, plan)
        zero = (optimizer, method, "zero", greedy)
        if mine in measured:
            seconds[arm.key] = statistics.median(measured[mine])
        elif protected == "mean" and zero in measured:
            seconds[arm.key] = statistics.median(measured[zero]) + extra
        else:
            seconds[arm.key] = arm_prior(arm, plan, costs, plain.get(arm.optimizer, []))
    return seconds


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
