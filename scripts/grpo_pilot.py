"""The GRPO pilot that chose the long run's GRPO learning rate: the unregularized pirate arm of the embedded plan,
a few steps, printing each step's mean reward (TRL's logged `reward`) and the seconds per step.

    python scripts/grpo_pilot.py --steps 24 --lr 1e-4

Reads the task from `scripts/results/long-run-smollm2/task.jsonl`; writes nothing but its output.
"""

import argparse
import copy
import dataclasses
import json
import time
from pathlib import Path

import datasets
from evidence.plan import Arm
from longrun.plan import EMBEDDED
from longrun.training import TrainerFactory
from transformers import PrinterCallback

from hf_cfp.loading.models import load_causal_lm

TASK = Path(__file__).parent / "results" / "long-run-smollm2" / "task.jsonl"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--reward", default="pirate")
    parser.add_argument("--output-dir", default="grpo-pilot")
    args = parser.parse_args(argv)
    datasets.disable_progress_bars()
    plan = dataclasses.replace(EMBEDDED, grpo_steps=args.steps, points=args.steps, grpo_learning_rate=args.lr)
    items = [json.loads(line) for line in TASK.read_text().splitlines()][: plan.task_prompts]
    model, tokenizer = load_causal_lm()
    factory = TrainerFactory(model, tokenizer, plan, items, None)
    arm = Arm(f"grpo-{args.reward}", "unregularized", 0.0, 0)
    trainer = factory.build(arm, copy.deepcopy(model).train(), [], Path(args.output_dir))
    trainer.remove_callback(PrinterCallback)
    start = time.perf_counter()
    trainer.train()
    print("seconds/step", (time.perf_counter() - start) / args.steps)
    print("mean reward per step", [round(e["reward"], 3) for e in trainer.state.log_history if "reward" in e])


if __name__ == "__main__":
    main()
