"""One trained arm of the long run: its trainer (SFT, DPO or GRPO), its method as a loss term or a callback, and
the curve measured along it (`CurveCallback`).

The method reaches the weights as in the evidence run (`evidence.training`): CFP, CFP-KFAC and the isotropic pull
through `CFPCallback` with lam = c / p99 of the (full) anchor; the KL penalty as the trainer's beta
(`KLPenaltySFTTrainer` for SFT); LwF through `baselines.with_distillation`; LoRA through PEFT (CFP-KFAC on a LoRA
model corrects B by the exact proximal step, `lora_rule="proximal_b"`). No drift is logged: the long run measures
KL on held-out prompts instead.

An arm is checkpointed at every measured step into its own directory; run again after an interruption, it resumes
from the last checkpoint (the Trainer's exact resume: weights, optimizer, schedule, data order, RNG; CFPCallback's
theta0; the curve measured so far) instead of starting over.
"""

import copy
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from datasets import Dataset
from evidence.controls import KLPenaltySFTTrainer
from evidence.plan import Arm, kfac_anchor_name, kfac_lam_anchor
from evidence.rewards import REWARDS
from evidence.training import lam_of, saved_reference
from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments, set_seed
from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer

from hf_cfp.anchor import FisherAnchor
from hf_cfp.integrations import CFPCallback
from hf_cfp.integrations.resume import checkpoint_dir
from hf_cfp.loading.examples import sft_examples

from .baselines import Distillation, lora_model, with_distillation
from .measure import Probe
from .plan import Plan, grpo_reward, summed_labels

CURVE_STATE = "longrun_curve.json"  # in every checkpoint: CurveCallback's points and seconds so far


class CurveCallback(TrainerCallback):
    """Measures `probe.point(model, ...)` of `arm` after the optimizer steps `steps` (after every other callback's
    correction: list it last) into `points` as {"step": s, ...}. Seconds, added up over every segment of a resumed arm:
    `elapsed()` from the start of training, `overhead` of it spent measuring and checkpointing (from the end of a
    step's callbacks to the end of the save's). Saves its state into every checkpoint (`CURVE_STATE`); `resume`
    reads it back."""

    def __init__(self, probe: Probe, arm: Arm, steps: list[int]):
        self.probe, self.arm, self.steps = probe, arm, set(steps)
        self.points: list[dict] = []
        self.overhead = self.earlier = 0.0  # earlier: the elapsed seconds of the segments before a resume
        self._started = self._stepped = time.perf_counter()

    def resume(self, checkpoint: Path) -> None:
        state = json.loads((checkpoint / CURVE_STATE).read_text(encoding="utf-8"))
        self.points, self.overhead, self.earlier = state["points"], state["overhead"], state["elapsed"]

    def elapsed(self) -> float:
        return self.earlier + time.perf_counter() - self._started

    def on_train_begin(self, args, state, control, **kwargs):
        self._started = time.perf_counter()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        start = time.perf_counter()
        if state.global_step in self.steps:
            self.points.append(
                {"step": state.global_step, **self.probe.point(model, self.arm.optimizer, self.arm.seed)}
            )
        self._stepped = time.perf_counter()
        self.overhead += self._stepped - start

    def on_save(self, args, state, control, **kwargs):
        self.overhead += time.perf_counter() - self._stepped
        saved = {"points": self.points, "overhead": self.overhead, "elapsed": self.elapsed()}
        Path(checkpoint_dir(args, state), CURVE_STATE).write_text(json.dumps(saved), encoding="utf-8")


def protection(arm: Arm, anchors: dict[str, FisherAnchor]) -> list[CFPCallback]:
    """The arm's `CFPCallback` (none for methods that act through the loss or not at all); `kfac_summed`: one
    callback protecting with every anchor of its label (`summed_labels`), each lam = c / p99 of its full anchor."""
    if arm.method == "kfac_summed":
        assert arm.anchor is not None, arm
        labels = summed_labels(arm.anchor)
        lams = [lam_of(anchors[kfac_lam_anchor(label)], arm.strength) for label in labels]
        return [CFPCallback([anchors[kfac_anchor_name(label)] for label in labels], lam=lams)]
    if arm.method in ("kfac", "lora_kfac"):
        assert arm.anchor is not None, arm
        lam = lam_of(anchors[kfac_lam_anchor(arm.anchor)], arm.strength)
        return [CFPCallback(anchors[kfac_anchor_name(arm.anchor)], lam=lam)]
    if arm.method in ("cfp", "isotropic"):
        lam = lam_of(anchors["math"], arm.strength)
        return [CFPCallback(anchors["isotropic" if arm.method == "isotropic" else "math"], lam=lam)]
    return []


def _arguments(plan: Plan, arm: Arm, output_dir: Path, learning_rate: float, checkpoints: bool) -> dict:
    batch = {"sft": plan.batch_size, "dpo": plan.dpo_batch_size}.get(arm.optimizer, plan.grpo_batch_size)
    steps = plan.steps_of(arm.optimizer)
    every = max(1, steps // plan.points)
    return {
        "output_dir": str(output_dir),
        "max_steps": steps,
        "per_device_train_batch_size": batch,
        "learning_rate": learning_rate,
        "lr_scheduler_type": "constant",
        "logging_steps": every,
        "save_strategy": "steps" if checkpoints else "no",  # at every measured step (module docstring)
        "save_steps": every,
        "save_total_limit": 2,  # the one before stays until the newest is whole (`last_whole_checkpoint`)
        "report_to": "none",
        "use_cpu": True,
        "seed": arm.seed,
        "disable_tqdm": True,
    }


class TrainerFactory:
    """Builds an arm's trainer on the task (`items`: the training prompts with their plain and pirate answers),
    checkpointing at every measured step unless `checkpoints=False` (a benchmark's trainers)."""

    def __init__(
        self,
        base_model,
        tokenizer,
        plan: Plan,
        items: list[dict],
        distillation: Distillation | None,
        checkpoints: bool = True,
    ):
        self.base_model, self.tokenizer, self.plan = base_model, tokenizer, plan
        self.items, self.distillation, self.checkpoints = items, distillation, checkpoints

    def _loss_extras(self, arm: Arm, trainer_class: type) -> tuple[type, dict]:
        if arm.method != "lwf":
            return trainer_class, {}
        return with_distillation(trainer_class), {"distillation": self.distillation, "distill_beta": arm.strength}

    def learning_rate(self, arm: Arm) -> float:
        if arm.method.startswith("lora"):
            return self.plan.lora_learning_rate
        rates = {"sft": self.plan.sft_learning_rate, "dpo": self.plan.dpo_learning_rate}
        return rates.get(arm.optimizer, self.plan.grpo_learning_rate)

    def build(self, arm: Arm, model, callbacks: list, output_dir: Path):
        args = _arguments(self.plan, arm, output_dir, self.learning_rate(arm), self.checkpoints)
        if arm.optimizer == "sft":
            return self._sft(arm, model, callbacks, args)
        if arm.optimizer == "dpo":
            return self._dpo(arm, model, callbacks, args)
        return self._grpo(arm, model, callbacks, args)

    def _sft(self, arm, model, callbacks, args) -> Trainer:
        dataset = sft_examples(self.tokenizer, [(item["prompt"], item["pirate"]) for item in self.items])
        common = {"model": model, "args": TrainingArguments(**args), "train_dataset": dataset, "callbacks": callbacks}
        if arm.method == "kl":
            return KLPenaltySFTTrainer(**common, ref_model=copy.deepcopy(self.base_model), kl_beta=arm.strength)
        trainer_class, extras = self._loss_extras(arm, Trainer)
        return trainer_class(**common, **extras)

    def _dpo(self, arm, model, callbacks, args) -> DPOTrainer:
        beta = arm.strength if arm.method == "kl" else self.plan.dpo_beta
        config = DPOConfig(**args, beta=beta, bf16=False, gradient_checkpointing=False)
        dataset = Dataset.from_dict(
            {
                "prompt": [[{"role": "user", "content": item["prompt"]}] for item in self.items],
                "chosen": [[{"role": "assistant", "content": item["pirate"]}] for item in self.items],
                "rejected": [[{"role": "assistant", "content": item["plain"]}] for item in self.items],
            }
        )
        trainer_class, extras = self._loss_extras(arm, DPOTrainer)
        # a reference copy per arm: accelerate sets an instance `forward` wrapper on it (`evidence.training`)
        reference = None if arm.method.startswith("lora") else copy.deepcopy(self.base_model)
        return trainer_class(
            model=model,
            ref_model=reference,
            args=config,
            train_dataset=dataset,
            processing_class=self.tokenizer,
            callbacks=callbacks,
            **extras,
        )

    def _grpo(self, arm, model, callbacks, args) -> GRPOTrainer:
        plan = self.plan
        if arm.method == "kl":  # GRPO loads its KL reference from the policy's `config._name_or_path`
            model.config._name_or_path = str(saved_reference(self.base_model, Path(args["output_dir"]) / "reference"))
        config = GRPOConfig(
            **args,
            beta=arm.strength if arm.method == "kl" else 0.0,
            num_generations=plan.grpo_generations,
            max_completion_length=plan.grpo_completion_tokens,
            temperature=1.0,
            bf16=False,
            gradient_checkpointing=False,
        )
        prompts = [[{"role": "user", "content": item["prompt"]}] for item in self.items]
        return GRPOTrainer(
            model=model,
            reward_funcs=REWARDS[str(grpo_reward(arm.optimizer))],
            args=config,
            train_dataset=Dataset.from_dict({"prompt": prompts}),
            processing_class=copy.deepcopy(self.tokenizer),  # the trainer may set its padding side
            callbacks=callbacks,
        )


def prepared_trainer(arm: Arm, factory: TrainerFactory, anchors: dict, callbacks: list, output_dir: Path):
    """The arm's trainer on a fresh copy of the base model (LoRA-wrapped for LoRA arms): its protection, then
    `callbacks` (after the correction), no console printer."""
    model = copy.deepcopy(factory.base_model).train()
    if arm.method.startswith("lora"):
        set_seed(arm.seed)  # the adapters' initialization follows the arm's seed
        model = lora_model(model, factory.plan.lora_rank)
    trainer = factory.build(arm, model, [*protection(arm, anchors), *callbacks], output_dir)
    trainer.remove_callback(PrinterCallback)
    return trainer


@dataclass
class TrainedArm:
    """What an arm's training leaves: the model, its curve points, {"train_seconds", "seconds_per_step"} (without
    measuring and checkpointing, over every segment), the logged history, and the seconds the segments before a
    resume took (0 for an arm run whole)."""

    model: Any
    curve: list[dict] = field(default_factory=list)
    timing: dict = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)
    earlier_seconds: float = 0.0


def last_whole_checkpoint(output_dir: Path) -> str | None:
    """The newest checkpoint in `output_dir` that every callback finished saving into (it holds `CURVE_STATE`,
    written last), or None. A save cut off part-way (the machine stopped during it) leaves a newer checkpoint
    without it; the Trainer has already rotated older ones out by then, hence `save_total_limit=2`."""
    whole = [path for path in output_dir.glob("checkpoint-*") if (path / CURVE_STATE).is_file()]
    return str(max(whole, key=lambda path: int(path.name.split("-")[-1]))) if whole else None


def train_arm(arm: Arm, factory: TrainerFactory, anchors: dict, probe: Probe, output_dir: Path) -> TrainedArm:
    """Train the arm with its checkpoints in `output_dir` (its own), resuming from the last one found there."""
    curve = CurveCallback(probe, arm, factory.plan.measured_steps(arm.optimizer))
    trainer = prepared_trainer(arm, factory, anchors, [curve], output_dir)
    checkpoint = last_whole_checkpoint(output_dir)
    if checkpoint is not None:
        curve.resume(Path(checkpoint))
        print(f"{arm.key}: resuming from {checkpoint}", flush=True)
    trainer.train(resume_from_checkpoint=checkpoint)
    seconds = curve.elapsed() - curve.overhead
    timing = {"train_seconds": seconds, "seconds_per_step": seconds / factory.plan.steps_of(arm.optimizer)}
    return TrainedArm(trainer.model, curve.points, timing, trainer.state.log_history, curve.earlier)
