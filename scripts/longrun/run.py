"""Run the long run: the task (built once from the base model's answers), the base references, then every arm of the
plan (each after the anchors it needs that are not saved yet), one JSON line per arm in `<output_dir>/results.jsonl`
as it finishes (`resume` skips the arms already there, as the evidence run does); several processes started on one
output directory share the arms (`workers`).

A row: `key`, `arm`, `steps` (optimizer steps; 0 for WiSE-FT), `metrics` (`measure.Probe.final`, plus
`train_seconds` and `seconds_per_step` without the measuring time), `math_examples` (`Probe.math_examples`: the
greedy answers to the first math problems), `curve` (`Probe.point` at every measured step, the last one at the end
of the run), `history` (the trainer's logged loss, reward and KL terms per logging step) and `seconds` (the arm's
wall time, measuring included; for an arm resumed after an interruption, the segments kept). The unregularized
run's final weights are kept in `<output_dir>/weights/` for its WiSE-FT points. An arm trains in
`<output_dir>/runs/<key>`, checkpointed at every measured step, and resumes from there when the run is started
again (`training.train_arm`); the directory is removed once the arm's row is written.
"""

import json
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import torch
from evidence.anchors import AnchorStore
from evidence.run import append_row, done_rows, tiny_model_and_tokenizer
from tqdm.auto import tqdm

from hf_cfp.loading.models import load_causal_lm
from hf_cfp.loading.prompts import calibration_prompts

from .baselines import Distillation, wise_ft
from .data import generic_prompts, task_items
from .measure import Probe, base_references
from .plan import Plan
from .training import TrainedArm, TrainerFactory, train_arm
from .workers import claim_next, exclusive

HISTORY_KEYS = ("step", "loss", "reward", "kl", "kl_penalty", "lwf_kl", "rewards/chosen", "rewards/margins")


def task_split(base_model, tokenizer, plan: Plan, path: Path) -> tuple[list[dict], list[dict]]:
    """(training items, held-out items) of the task: `data.task_items` of the first `task_prompts +
    heldout_prompts` generic prompts, made once and cached as JSON lines at `path`."""
    if not path.exists():
        prompts = generic_prompts()[: plan.task_prompts + plan.heldout_prompts]
        print(f"Writing the task: the base model's greedy answers to {len(prompts)} prompts", flush=True)
        items = task_items(base_model, tokenizer, prompts, plan.task_new_tokens)
        path.write_text("".join(json.dumps(item) + "\n" for item in items), encoding="utf-8")
    items = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    training = set(generic_prompts()[: plan.task_prompts])
    return [i for i in items if i["prompt"] in training], [i for i in items if i["prompt"] not in training]


def lwf_targets(model, tokenizer, plan: Plan, arms: list, path: Path) -> Distillation | None:
    """The LwF targets on the math anchor's calibration sequences (cached at `path`) when `arms` has an LwF arm."""
    if not any(arm.method == "lwf" for arm in arms):
        return None
    sizes = plan.anchors
    prompts = calibration_prompts("math")
    return Distillation(
        model, tokenizer, prompts, sizes.anchor_sequences, sizes.anchor_new_tokens, plan.batch_size, path
    )


def trained_weights(model) -> dict[str, torch.Tensor]:
    """The model's parameters by name (tied ones once), detached copies."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}


class LongRun:
    """Everything an arm needs, made once: model, task, anchor store, references, probe."""

    def __init__(self, plan: Plan, model_name: str, out: Path, anchors_dir: Path, todo: list):
        self.plan, self.out = plan, out
        model, tokenizer = tiny_model_and_tokenizer() if model_name == "tiny" else load_causal_lm(model_name)
        self.base_model, self.tokenizer = model.eval(), tokenizer
        self.items, self.heldout = task_split(model, tokenizer, plan, out / "task.jsonl")
        self.store = AnchorStore(model, tokenizer, plan.anchors, anchors_dir)
        print("Drawing the base model's held-out responses (once)", flush=True)
        references = base_references(model, tokenizer, plan, out / "references.pt")
        self.probe = Probe(model, tokenizer, plan, self.heldout, references)
        distillation = lwf_targets(model, tokenizer, plan, todo, out / "distillation.pt")
        self.factory = TrainerFactory(model, tokenizer, plan, self.items, distillation)

    def weights_path(self, arm) -> Path:
        return self.out / "weights" / f"{arm.optimizer}-seed{arm.seed}.pt"

    def run_dir(self, arm) -> Path:
        """Where the arm trains and keeps its checkpoints."""
        return self.out / "runs" / arm.key.replace("/", "_")

    def run_arm(self, arm) -> dict:
        """One arm's row (module docstring)."""
        start = time.perf_counter()
        if arm.method == "wiseft":
            trained = torch.load(self.weights_path(arm), weights_only=True)
            done = TrainedArm(wise_ft(self.base_model, trained, arm.strength))
        else:
            anchors = self.store.for_arm(self.plan.anchors_of(arm))
            done = train_arm(arm, self.factory, anchors, self.probe, self.run_dir(arm))
            if arm.method == "unregularized":
                self.weights_path(arm).parent.mkdir(exist_ok=True)
                torch.save(trained_weights(done.model), self.weights_path(arm))
        metrics = {**self.probe.final(done.model, arm.optimizer, arm.seed), **done.timing}
        logged = [{k: entry[k] for k in HISTORY_KEYS if k in entry} for entry in done.history if "loss" in entry]
        steps = 0 if arm.method == "wiseft" else self.plan.steps_of(arm.optimizer)
        return {
            "key": arm.key,
            "arm": asdict(arm),
            "steps": steps,
            "metrics": metrics,
            "math_examples": self.probe.math_examples(done.model),
            "curve": done.curve,
            "history": logged,
            "seconds": time.perf_counter() - start + done.earlier_seconds,
        }


def run_long(plan: Plan, model_name: str, output_dir: str, anchors_dir: str | None = None) -> list[dict]:
    """Every arm of `plan` not yet in `<output_dir>/results.jsonl`, shared with any other process started on the
    same directory (`workers`); returns the rows written so far (base first, then in plan order)."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.jsonl"
    arms = plan.arms()
    with exclusive(out):  # the first worker makes the task, the references, the LwF targets and the base row
        done = done_rows(results)
        todo = [arm for arm in arms if arm.key not in done]
        run = LongRun(plan, model_name, out, Path(anchors_dir) if anchors_dir else out / "anchors", todo)
        if "base" not in done:
            append_row(results, base_row(run, plan))
    bar = tqdm(total=len(todo), desc="arms (this worker)", unit="arm")
    while True:
        with exclusive(out):
            arm = claim_next(arms, done_rows(results), run.run_dir)
            if arm is None:
                break
            run.store.prepare(plan.anchors_of(arm))  # made when first needed, outside the arm's seconds
        bar.set_postfix_str(arm.key)
        row = run.run_arm(arm)
        with exclusive(out):
            append_row(results, row)
        shutil.rmtree(run.run_dir(arm), ignore_errors=True)
        bar.update()
        tqdm.write(f"{arm.key}: math kl {row['metrics']['math/kl']:.4g}, {row['seconds']:.0f} s")
    rows = done_rows(results)
    return [rows[key] for key in ["base", *(arm.key for arm in arms)] if key in rows]


def base_row(run: LongRun, plan: Plan) -> dict:
    """The base model's row (measured as the arms' final points)."""
    rewarded = plan.optimizers[-1]  # a GRPO optimizer when the plan has one: the base's rewards too
    return {
        "key": "base",
        "steps": 0,
        "metrics": run.probe.final(run.base_model, rewarded),
        "math_examples": run.probe.math_examples(run.base_model),
    }
