"""Does `kl_budget` hold the measured KL on the embedded model? SFT on the long run's pirate task (its learning rate
and batch), protected by the math anchor with `CFPCallback(kl_budget=B, kl_prompts=P, kl_every=k, kl_control=rule)`.

    python scripts/kl_budget_run.py --tiny       # the pipeline on a random tiny model (seconds)
    python scripts/kl_budget_run.py --plot       # the embedded model, the diagonal anchor, the default rule
    python scripts/kl_budget_run.py --anchor ../behaviour-smollm2/anchors/math_kfac --kfac-rank 256 \
        --control adaptive --output-dir kl-budget-smollm2/kfac-adaptive      # K-FAC rank 256 + tails, PPO's rule
    python scripts/kl_budget_run.py --compare kl-budget-smollm2/*/         # the runs side by side: compare.png

The anchor is the long run's diagonal math anchor (`--anchor`, a saved anchor directory), or a K-FAC one truncated
to `--kfac-rank` eigenpairs with mean tails (`evidence.truncated_anchor`, the long run's `math_t256`).

The controller measures on 24 generated arithmetic prompts (`longrun.data.math_problems`, seed 1; 4 base responses
of up to 64 tokens each, `kl_prompts`' default). Independently of it, the long run's held-out math KL (the 24
bundled items, 4 responses of up to 32 tokens each) is measured every `--check-every` steps, so the report shows
both what was held and what a user would check. lam starts at c / p99(F) (c = `--start`, the strength guide's
rule). The held-out task gain (the long run's `task/sft_gain`) is measured with the checks. Writes
`kl_budget.json` (every logged step's measured KL and lam, the independent checks, the settings and the wall
time) and with `--plot` `kl_budget.png`.
"""

import argparse
import copy
import json
import os
import time
from dataclasses import replace
from pathlib import Path

import datasets
from evidence import truncated_anchor
from evidence.plan import Arm
from longrun.data import math_problems
from longrun.plan import EMBEDDED, TINY
from longrun.training import TrainerFactory
from transformers import PrinterCallback, TrainerCallback

from hf_cfp import CFPCallback, FisherAnchor, estimate_fisher
from hf_cfp.evaluation import answer_log_probs, draw_base_responses
from hf_cfp.integrations.kl_control import RULES
from hf_cfp.loading.models import load_causal_lm, tiny_llama, tiny_tokenizer
from hf_cfp.loading.prompts import eval_items
from hf_cfp.names import LAM, MEASURED_KL

RESULTS = Path(__file__).parent / "results"
ARM = Arm("sft", "unregularized", 0.0, 0)  # the trainer of the long run's SFT arms; CFP comes as a callback


class Checks(TrainerCallback):
    """Records every logged step's measured KL and lam, and every `every` steps the independent held-out math KL and
    the held-out task gain (the long run's `task/sft_gain`: the mean per-token log-likelihood gain of the pirate
    answers of the held-out prompts over the base model's)."""

    def __init__(self, heldout, task: "TaskGain", every: int, anchor: str):
        self.heldout, self.task, self.every, self.anchor = heldout, task, every, anchor
        self.logged, self.checks = [], []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and MEASURED_KL.key(self.anchor) in logs:
            kl, lam = logs[MEASURED_KL.key(self.anchor)], logs[LAM.key(self.anchor)]
            self.logged.append({"step": state.global_step, "kl": kl, "lam": lam})

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every == 0:
            estimate = self.heldout.kl(kwargs["model"])
            gain = self.task.gain(kwargs["model"])
            self.checks.append({"step": state.global_step, "kl": estimate.kl, "stderr": estimate.stderr, **gain})


class TaskGain:
    """The held-out task gain of a model against the base's per-token log-likelihoods, computed once."""

    def __init__(self, base_model, tokenizer, items: list[dict]):
        self.tokenizer, self.prompts = tokenizer, [item["prompt"] for item in items]
        self.answers = [item["pirate"] for item in items]
        self.base = self._per_token(base_model)

    def _per_token(self, model):
        sums, lengths = answer_log_probs(model, self.tokenizer, self.prompts, self.answers)
        return sums / lengths

    def gain(self, model) -> dict[str, float]:
        gains = self._per_token(model) - self.base
        return {"task_gain": float(gains.mean()), "task_gain_stderr": float(gains.std()) / len(gains) ** 0.5}


def setup(tiny: bool, anchor_dir: str, kfac_rank: int | None):
    """(model, tokenizer, math anchor, training items, held-out items) of the embedded model (the anchor saved in
    `anchor_dir`, truncated to `kfac_rank` with mean tails if given) or the tiny one."""
    if tiny:
        tokenizer = tiny_tokenizer()
        model = tiny_llama(vocab_size=len(tokenizer), hidden_size=32)
        prompts = [q for q, _ in math_problems(8, seed=2)]
        anchor = estimate_fisher(model, tokenizer, prompts, num_sequences=8, max_new_tokens=8, name="math")
        items = [
            {"prompt": f"Tell me about {w}.", "pirate": f"Arr, {w} be fine.", "plain": f"{w} is fine."}
            for w in ("ships", "rain", "bread", "cats")
        ]
        return model, tokenizer, anchor, items, items
    model, tokenizer = load_causal_lm()
    anchor = FisherAnchor.from_pretrained(anchor_dir)
    if kfac_rank is not None:
        anchor = truncated_anchor(anchor, kfac_rank, f"math_t{kfac_rank}", tail="mean")
    task = RESULTS / "long-run-smollm2" / "task.jsonl"
    items = [json.loads(line) for line in task.read_text().splitlines()]
    return model, tokenizer, anchor, items[: EMBEDDED.task_prompts], items[EMBEDDED.task_prompts :]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--budget", type=float, default=1.0, help="kl_budget, nats")
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--every", type=int, default=8, help="kl_every")
    parser.add_argument("--check-every", type=int, default=16)
    parser.add_argument("--start", type=float, default=1.0, help="lam starts at start / p99(F)")
    parser.add_argument("--control", choices=RULES, default=RULES[0], help="kl_control, the controller's rule")
    parser.add_argument("--anchor", default="evidence-smollm2/anchors/math", help="the saved math anchor")
    parser.add_argument("--kfac-rank", type=int, default=None, help="truncate a K-FAC anchor to this rank, mean tails")
    parser.add_argument("--seed", type=int, default=0, help="the training seed (data order), as the long run's arms")
    parser.add_argument("--output-dir", default=None)
    parser.add_argument("--plot", action="store_true")
    parser.add_argument("--compare", nargs="+", default=None, help="output directories to draw side by side")
    parser.add_argument("--compare-plot", default=None, help="where --compare draws (default: compare.png by them)")
    args = parser.parse_args(argv)
    if args.compare:
        records = {Path(d).name: json.loads((Path(d) / "kl_budget.json").read_text()) for d in args.compare}
        path = Path(args.compare_plot or Path(args.compare[0]).parent / "compare.png")
        print(f"Plot: {plot_compare(records, path)}")
        return
    datasets.disable_progress_bars()
    out = Path(args.output_dir or ("kl-budget-tiny" if args.tiny else "kl-budget-smollm2"))
    model, tokenizer, anchor, items, heldout_items = setup(args.tiny, args.anchor, args.kfac_rank)
    plan = TINY if args.tiny else EMBEDDED
    control = [q for q, _ in math_problems(24, seed=1)]
    measured = draw_base_responses(model, tokenizer, control, max_new_tokens=8 if args.tiny else 64)
    heldout = draw_base_responses(  # the long run's held-out math KL (its prompts, responses and length)
        model, tokenizer, [q for q, _ in eval_items("math")][: plan.kl_prompts], plan.kl_samples, plan.kl_new_tokens
    )
    lam = args.start / anchor.metadata["statistics"]["p99"]
    cfp = CFPCallback(
        anchor, lam=lam, kl_budget=args.budget, kl_prompts=measured, kl_every=args.every, kl_control=args.control
    )
    checks = Checks(heldout, TaskGain(model, tokenizer, heldout_items), args.check_every, anchor.name)
    # the long run's SFT settings, `steps` long, logging at every measurement
    plan = replace(plan, steps=args.steps, points=args.steps // args.every)
    factory = TrainerFactory(model, tokenizer, plan, items, None)
    arm = replace(ARM, seed=args.seed)
    trainer = factory.build(arm, copy.deepcopy(model).train(), [cfp, checks], out)
    trainer.remove_callback(PrinterCallback)
    start = time.perf_counter()
    trainer.train()
    record = {
        **vars(args),
        "lam_start": lam,
        "seconds": time.perf_counter() - start,
        "logged": checks.logged,
        "checks": checks.checks,
        "learning_rate": factory.learning_rate(arm),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "kl_budget.json").write_text(json.dumps(record, indent=1))
    print(summary(record))
    if args.plot:
        print(f"Plot: {plot(record, out / 'kl_budget.png')}")


def summary(record: dict) -> str:
    """How close the controller held the measured KL to the budget: the largest measurement, and how many lie within
    25% of it from the first above 0.75 of it."""
    budget, logged = record["budget"], record["logged"]
    reached = next((i for i, row in enumerate(logged) if row["kl"] > 0.75 * budget), None)
    after = logged[reached:] if reached is not None else []
    inside = sum(0.75 * budget <= row["kl"] <= 1.25 * budget for row in after)
    first = after[0]["step"] if after else "never"
    largest = max(row["kl"] for row in logged) / budget if logged else float("nan")
    kls = [round(row["kl"], 3) for row in logged]
    lams = [float(format(row["lam"], ".3g")) for row in logged]
    checks = [
        (c["step"], round(c["kl"], 3), round(c["stderr"], 3), round(c["task_gain"], 3)) for c in record["checks"]
    ]
    return (
        f"kl_budget {budget:g} ({record.get('control', 'adaptive')}): above 0.75 of it first at step {first}; "
        f"{inside} of {len(after)} measurements since within 25%; the largest {largest:.2f} x the budget\n"
        f"measured KL {kls}\nlam {lams}\nheld-out (step, math KL, stderr, task gain) {checks}"
    )


def plot(record: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budget = record["budget"]
    figure, (kl_axis, task_axis) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    steps = [row["step"] for row in record["logged"]]
    kl_axis.axhspan(0.75 * budget, 1.25 * budget, color="0.9", label="budget +-25%")
    kl_axis.plot(steps, [row["kl"] for row in record["logged"]], "o-", label="measured KL (kl_prompts)")
    checks = record["checks"]
    check_steps = [c["step"] for c in checks]
    kl_axis.errorbar(
        check_steps, [c["kl"] for c in checks], [1.96 * c["stderr"] for c in checks], fmt="s", label="held-out math KL"
    )
    kl_axis.set_ylabel("KL to the base, nats")
    lam_axis = kl_axis.twinx()
    lam_axis.plot(steps, [row["lam"] for row in record["logged"]], "k--", alpha=0.5, label="lam")
    lam_axis.set_ylabel("lam (dashed)")
    lam_axis.set_yscale("log")
    kl_axis.legend(loc="upper left", fontsize=8)
    task_axis.errorbar(
        check_steps, [c["task_gain"] for c in checks], [1.96 * c["task_gain_stderr"] for c in checks], fmt="s-"
    )
    task_axis.set(xlabel="optimizer step", ylabel="held-out task gain (nats/token)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return path


def plot_compare(records: dict[str, dict], path: Path) -> Path:
    """The runs side by side over steps: measured KL (with the budget's +-25% band), held-out math KL, lam, and the
    held-out task gain, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    (measured, heldout), (lams, task) = axes
    budget = next(iter(records.values()))["budget"]
    measured.axhspan(0.75 * budget, 1.25 * budget, color="0.9")
    for label, record in records.items():
        steps = [row["step"] for row in record["logged"]]
        line = measured.plot(steps, [row["kl"] for row in record["logged"]], "o-", ms=3, label=label)[0]
        lams.plot(steps, [row["lam"] for row in record["logged"]], "-", color=line.get_color())
        checks = record["checks"]
        at = [c["step"] for c in checks]
        heldout.errorbar(at, [c["kl"] for c in checks], [1.96 * c["stderr"] for c in checks], fmt="s-", ms=3)
        task.errorbar(at, [c["task_gain"] for c in checks], [1.96 * c["task_gain_stderr"] for c in checks], fmt="s-")
    measured.set(ylabel="measured KL (kl_prompts), nats", title=f"kl_budget {budget:g} (band: +-25%)")
    heldout.set(ylabel="held-out math KL, nats")
    positive = all(row["lam"] > 0 for record in records.values() for row in record["logged"])
    lams.set(ylabel="lam", yscale="log" if positive else "symlog", xlabel="optimizer step")  # log labels one decade
    task.set(ylabel="held-out task gain (nats/token)", xlabel="optimizer step")
    measured.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return path


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
