"""The predicted-KL budget on a real model: for each budget B, an SFT run under
`CFPCallback(math, predicted_kl_budget=B)`, and what came of it: the predicted KL 0.5 Delta^T F Delta at the last
step (which the budget bounds), the measured KL(mu_0 || mu_theta) on the anchor's own calibration prompts and on
held-out math prompts, and the task's gain. Plus, over the evidence experiment's arms, how the predicted KL compares
with the measured one.

Results go to `<output_dir>/results.jsonl` as they finish (resumable, like the evidence run); anchors are
shared with the evidence experiment's directory when given the same one.
"""

import copy
import math
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import torch

from hf_cfp.evaluation import draw_base_responses
from hf_cfp.fisher.staleness import reestimate, top1_overlap
from hf_cfp.loading.models import load_causal_lm
from hf_cfp.loading.prompts import calibration_prompts

from .anchors import load_or_estimate_anchors
from .measure import CapabilityProbe
from .plan import Arm, Plan
from .run import append_row, done_rows, tiny_model_and_tokenizer
from .training import train_arm


def budget_arms(budgets: tuple[float, ...], seed: int = 0) -> list[Arm]:
    """The unregularized SFT run (the path the budget is measured against), then one run per budget."""
    return [Arm("sft", "unregularized", 0.0, seed)] + [Arm("sft", "budget", b, seed, "math") for b in budgets]


def run_budget_table(
    plan: Plan, model_name: str, budgets: tuple[float, ...], output_dir: str, anchor_dir: str, scaling: bool = False
) -> tuple[list[dict], list[dict]]:
    """One row per arm of `budget_arms`: predicted KL (math anchor), measured KL on the calibration prompts
    (`math/calibration_kl`) and held-out ones (`math/kl`), task gain, seconds; with `scaling`, also
    `displacement_scaling` along the unregularized run's displacement and, last, the staleness of the math
    anchor after that run (`top1_overlap_now` of F re-estimated at its weights, and the seconds it took)."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.jsonl"
    done = done_rows(path)
    base_model, tokenizer = tiny_model_and_tokenizer() if model_name == "tiny" else load_causal_lm(model_name)
    anchors = load_or_estimate_anchors(base_model, tokenizer, plan, Path(anchor_dir))
    print("Drawing the base model's responses on held-out and calibration prompts (once)", flush=True)
    probe = CapabilityProbe(base_model, tokenizer, plan)
    calibration = draw_base_responses(
        base_model,
        tokenizer,
        calibration_prompts("math")[: plan.kl_prompts],
        plan.kl_samples,
        plan.kl_new_tokens,
        seed=0,
        batch_size=8,
    )
    arms = budget_arms(budgets)
    unregularized = None
    for arm in arms:
        if arm.key in done:
            continue
        start = time.perf_counter()
        model, drift = train_arm(arm, base_model, tokenizer, anchors, plan, out / "runs")
        unregularized = model if arm.method == "unregularized" else unregularized
        measured = calibration.kl(model)
        metrics = {
            **drift,
            **probe.measure(model, greedy=False),
            "math/predicted_kl": drift["math/dtfd"] / 2,
            "math/calibration_kl": measured.kl,
            "math/calibration_kl_stderr": measured.stderr,
        }
        done[arm.key] = {
            "key": arm.key,
            "arm": asdict(arm),
            "metrics": metrics,
            "seconds": time.perf_counter() - start,
        }
        append_row(path, done[arm.key])
        print(f"{arm.key}: predicted {metrics['math/predicted_kl']:.4g}, calibration KL {measured.kl:.4g} nats")
    rows = [done[arm.key] for arm in arms]
    if not scaling:
        return rows, []
    if unregularized is None:  # resumed: train it again (the same seed gives the same run)
        unregularized, _ = train_arm(arms[0], base_model, tokenizer, anchors, plan, out / "runs")
    along = displacement_scaling(base_model, unregularized, anchors["math"], calibration)
    start = time.perf_counter()
    now = reestimate(anchors["math"], unregularized, tokenizer, calibration_prompts("math"))
    seconds = time.perf_counter() - start
    staleness = {"scale": "staleness", "top1_overlap_now": top1_overlap(anchors["math"], now), "seconds": seconds}
    return rows, [*along, staleness]


def displacement_scaling(base_model, trained, anchor, calibration, scales=(1.0, 0.3, 0.1, 0.03, 0.01)) -> list[dict]:
    """Why the predicted KL is off: along the trained displacement Delta = theta_trained - theta0, the measured KL
    of theta0 + s Delta (on `calibration`, base responses drawn once) against the diagonal prediction
    0.5 s^2 sum_i F_i Delta_i^2. A ratio that stays far above 1 as s -> 0 is the diagonal's missing cross terms
    (second order holds for the full F there); a ratio that falls toward 1 is the path leaving the quadratic
    regime."""
    base = {n: p.detach() for n, p in base_model.named_parameters()}
    moved = {n: p.detach() for n, p in trained.named_parameters()}
    diagonal = 0.5 * sum(
        float((anchor.fisher[n].double() * (moved[n] - base[n]).double() ** 2).sum()) for n in anchor.fisher
    )
    probe = copy.deepcopy(base_model)
    rows = []
    with torch.no_grad():
        for scale in scales:
            for name, param in probe.named_parameters():
                param.copy_(base[name] + scale * (moved[name] - base[name]))
            measured = calibration.kl(probe)
            predicted = scale**2 * diagonal
            rows.append({"scale": scale, "predicted": predicted, "measured": measured.kl, "stderr": measured.stderr})
    return rows


def scaling_markdown(rows: list[dict]) -> str:
    """The `displacement_scaling` table, then the staleness line."""
    lines = ["| s | predicted KL | measured KL (calibration) | measured / predicted |", "|---|---|---|---|"]
    *rows, staleness = rows
    for r in rows:
        ratio = r["measured"] / r["predicted"] if r["predicted"] > 0 else math.nan
        lines.append(
            f"| {r['scale']:g} | {r['predicted']:.3g} | {r['measured']:.3g} ± {r['stderr']:.2g} | {ratio:.3g} |"
        )
    lines.append(
        f"\nStaleness after the unregularized run: the math anchor's top-1% set keeps "
        f"{staleness['top1_overlap_now']:.1%} of its coordinates at the trained weights (re-estimated in "
        f"{staleness['seconds']:.0f} s)."
    )
    return "\n".join(lines) + "\n"


def budget_markdown(rows: list[dict]) -> str:
    """The table: budget -> final predicted KL, measured KL (calibration and held-out prompts, +- stderr),
    task gain and final loss."""
    lines = [
        "| run | budget (nats) | predicted KL | calibration KL | held-out math KL | task/sft_gain | loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        arm, m = row["arm"], row["metrics"]
        budget = f"{arm['strength']:g}" if arm["method"] == "budget" else "none"
        name = "unregularized" if arm["method"] == "unregularized" else "CFP predicted_kl_budget [math]"
        lines.append(
            f"| {name} | {budget} | {m['math/predicted_kl']:.3g} | {m['math/calibration_kl']:.3g} ± "
            f"{m['math/calibration_kl_stderr']:.2g} | {m['math/kl']:.3g} ± {m['math/kl_stderr']:.2g} | "
            f"{m['task/sft_gain']:.3g} | {m['loss']:.3g} |"
        )
    return "\n".join(lines) + "\n"


def prediction_summary(rows: list[dict]) -> str:
    """Over result rows with a math DtFD and a measured math KL (the evidence arms): the ratio measured /
    predicted KL, predicted = DtFD / 2 = 0.5 Delta^T F_math Delta, as median and range, and the rank
    correlation (Spearman) of the two across arms."""
    pairs = [
        (r["metrics"]["math/dtfd"] / 2, r["metrics"]["math/kl"])
        for r in rows
        if "math/dtfd" in r["metrics"] and r["metrics"]["math/dtfd"] > 0
    ]
    if len(pairs) < 2:
        return "Too few arms with a math DtFD and a measured math KL to compare.\n"
    ratios = sorted(kl / predicted for predicted, kl in pairs)
    rho = _spearman([p for p, _ in pairs], [k for _, k in pairs])
    return (
        f"Over {len(pairs)} arms: measured held-out math KL / predicted KL: median {statistics.median(ratios):.3g}, "
        f"range {ratios[0]:.3g} to {ratios[-1]:.3g}; Spearman rank correlation {rho:.2f}.\n"
    )


def _spearman(x: list[float], y: list[float]) -> float:
    """Pearson correlation of the ranks (ties get the mean rank)."""

    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        result = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                result[order[k]] = (i + j) / 2
            i = j + 1
        return result

    rx, ry = ranks(x), ranks(y)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    return cov / math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
