"""Seconds per optimizer step of every method of the long run, side by side: what each protection and baseline costs
on top of its optimizer's own step (`docs/reports/evidence.md`, "Cost").

Each round trains every arm of the long run at its first strength (`longrun.plan.EMBEDDED`, seed 0; WiSE-FT and
early stopping need no training) for --steps optimizer steps, one arm after another, on a fresh copy of the base
model; the first step of each arm is warm-up and dropped. A step is timed from `on_step_begin` to `on_step_end`
after the arm's correction (GRPO: its generation included). The table gives per arm the median of its timed steps
over every round and its ratio to the unregularized arm of the same optimizer; the last lines are machine-readable:

    RESULT <arm key>=<ratio to unregularized>

    python scripts/bench_methods.py [--optimizers sft,dpo,grpo-pirate] [--steps 5] [--rounds 1]
    python scripts/bench_methods.py --tiny        # a random tiny Llama: checks the script, not the cost

The embedded run reads the anchors from --anchors-dir and the task and the LwF sequences from --cache-dir (the long
run's output directory), making what is absent as the long run does.
"""

import argparse
import dataclasses
import os
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import datasets
import torch
from evidence.anchors import AnchorStore
from evidence.run import tiny_model_and_tokenizer
from longrun.plan import EMBEDDED, TINY, Plan
from longrun.report import method_label
from longrun.run import lwf_targets, task_split
from longrun.training import TrainerFactory, prepared_trainer
from tqdm.auto import tqdm
from transformers import TrainerCallback

from hf_cfp.loading.models import load_causal_lm


class StepTimer(TrainerCallback):
    """The seconds of every optimizer step, `on_step_begin` to `on_step_end` (list it after the correction)."""

    def __init__(self):
        self.seconds: list[float] = []
        self.start = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(time.perf_counter() - self.start)


def bench_arms(plan: Plan, optimizers: list[str]) -> list:
    """The arms timed: every trained arm of `optimizers` at its first strength, seed 0."""
    return [arm for o in optimizers for arm in plan.runs(o, 0, True) if arm.method != "wiseft"]


def timed_steps(plan: Plan, model, tokenizer, arms: list, rounds: int, anchors_dir: Path, cache: Path) -> dict:
    """{arm key: the seconds of its timed steps over every round} (module docstring)."""
    store = AnchorStore(model, tokenizer, plan.anchors, anchors_dir)
    store.prepare({name for arm in arms for name in plan.anchors_of(arm)})
    items, _ = task_split(model, tokenizer, plan, cache / "task.jsonl")
    distillation = lwf_targets(model, tokenizer, plan, arms, cache / "distillation.pt")
    factory = TrainerFactory(model, tokenizer, plan, items, distillation, checkpoints=False)
    seconds: dict[str, list[float]] = defaultdict(list)
    with tempfile.TemporaryDirectory() as scratch:
        for number in range(rounds):
            for arm in tqdm(arms, desc=f"round {number + 1}/{rounds}", unit="arm"):
                timer = StepTimer()
                anchors = store.for_arm(plan.anchors_of(arm))
                trainer = prepared_trainer(arm, factory, anchors, [timer], Path(scratch) / "trainer")
                trainer.train()
                seconds[arm.key] += timer.seconds[1:]
    return dict(seconds)


def cost_table(plan: Plan, arms: list, seconds: dict[str, list[float]]) -> tuple[str, dict[str, float]]:
    """(the markdown table, {arm key: median seconds per step / the unregularized arm's of its optimizer})."""
    medians = {key: statistics.median(values) for key, values in seconds.items()}
    unregularized = {arm.optimizer: medians[arm.key] for arm in arms if arm.method == "unregularized"}
    ratios = {arm.key: medians[arm.key] / unregularized[arm.optimizer] for arm in arms}
    lines = ["| optimizer | method | strength | s/step (median) | x unregularized |", "|---|---|---|---|---|"]
    for arm in arms:
        label = "unregularized" if arm.method == "unregularized" else method_label(dataclasses.asdict(arm), plan)
        cells = [arm.optimizer, label, f"{arm.strength:g}", f"{medians[arm.key]:.2f}", f"{ratios[arm.key]:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines), ratios


def main(argv=None) -> dict[str, list[float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a random tiny Llama: checks the script, not the cost")
    parser.add_argument("--optimizers", default="sft,dpo,grpo-pirate", help="comma-separated, of the plan's")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per arm and round (the first dropped)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--anchors-dir", default="evidence-smollm2/anchors")
    parser.add_argument("--cache-dir", default="long-run-smollm2", help="the long run's output directory")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2: the first step of each arm is warm-up and dropped")
    datasets.disable_progress_bars()
    base = TINY if args.tiny else EMBEDDED
    plan = dataclasses.replace(base, steps=args.steps, grpo_steps=args.steps, points=1)
    optimizers = args.optimizers.split(",")
    unknown = sorted(set(optimizers) - set(plan.optimizers))
    if unknown:
        parser.error(f"unknown optimizers {unknown}; the plan has {list(plan.optimizers)}")
    model, tokenizer = tiny_model_and_tokenizer() if args.tiny else load_causal_lm()
    arms = bench_arms(plan, optimizers)
    with tempfile.TemporaryDirectory() as tiny_cache:
        anchors_dir = Path(tiny_cache) / "anchors" if args.tiny else Path(args.anchors_dir)
        cache = Path(tiny_cache) if args.tiny else Path(args.cache_dir)
        cache.mkdir(parents=True, exist_ok=True)
        seconds = timed_steps(plan, model.eval(), tokenizer, arms, args.rounds, anchors_dir, cache)
    table, ratios = cost_table(plan, arms, seconds)
    threads = torch.get_num_threads()
    print(f"\n{args.rounds} round(s) of {args.steps} steps per arm, the first dropped; {threads} torch threads\n")
    print(table)
    for key, ratio in ratios.items():
        print(f"RESULT {key}={ratio:.3f}")
    return seconds


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
