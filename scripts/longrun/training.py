"""One trained arm of the long run: its trainer (SFT, DPO or GRPO), its method as a loss term or a callback, and
the curve measured along it (`CurveCallback`).

The method reaches the weights as in the evidence run (`evidence.training`): CFP, CFP-KFAC and the isotropic pull
through `CFPCallback` with lam = c / p99 of the (full) anchor; the KL penalty as the trainer's beta
(`KLPenaltySFTTrainer` for SFT); LwF through `baselines.with_distillation`; LoRA through PEFT (CFP-KFAC on a LoRA
model corrects B by the exact proximal step, `lora_rule="proximal_b"`). No drift is logged: the long run measures
KL on held-out prompts instead.
"""

import copy
import time
from pathlib import Path

from datasets import Dataset
from evidence.controls import KLPenaltySFTTrainer
from evidence.plan import Arm, kfac_anchor_name, kfac_lam_anchor
from evidence.rewards import REWARDS
from evidence.training import lam_of, saved_reference
from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments
from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer

from hf_cfp.anchor import FisherAnchor
from hf_cfp.integrations import CFPCallback
from hf_cfp.loading.examples import sft_examples

from .baselines import Distillation, lora_model, with_distillation
from .measure import Probe
from .plan import Plan, grpo_reward


class CurveCallback(TrainerCallback):
    """Measures `probe.point(model)` after the optimizer steps `steps` (after every other callback's correction:
    list it last) into `points` as {"step": s, ...}; `measuring` adds up the seconds spent measuring."""

    def __init__(self, probe: Probe, steps: list[int]):
        self.probe, self.steps = probe, set(steps)
        self.points: list[dict] = []
        self.measuring = 0.0

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step in self.steps:
            start = time.perf_counter()
            self.points.append({"step": state.global_step, **self.probe.point(model)})
            self.measuring += time.perf_counter() - start


def protection(arm: Arm, anchors: dict[str, FisherAnchor]) -> list[CFPCallback]:
    """The arm's `CFPCallback` (none for methods that act through the loss or not at all)."""
    if arm.method in ("kfac", "lora_kfac"):
        assert arm.anchor is not None, arm
        lam = lam_of(anchors[kfac_lam_anchor(arm.anchor)], arm.strength)
        return [CFPCallback(anchors[kfac_anchor_name(arm.anchor)], lam=lam)]
    if arm.method in ("cfp", "isotropic"):
        lam = lam_of(anchors["math"], arm.strength)
        return [CFPCallback(anchors["isotropic" if arm.method == "isotropic" else "math"], lam=lam)]
    return []


def _arguments(plan: Plan, arm: Arm, output_dir: Path, learning_rate: float) -> dict:
    batch = {"sft": plan.batch_size, "dpo": plan.dpo_batch_size}.get(arm.optimizer, plan.grpo_batch_size)
    steps = plan.steps_of(arm.optimizer)
    return {
        "output_dir": str(output_dir),
        "max_steps": steps,
        "per_device_train_batch_size": batch,
        "learning_rate": learning_rate,
        "lr_scheduler_type": "constant",
        "logging_steps": max(1, steps // plan.points),
        "save_strategy": "no",
        "report_to": "none",
        "use_cpu": True,
        "seed": arm.seed,
        "disable_tqdm": True,
    }


class TrainerFactory:
    """Builds an arm's trainer on the task (`items`: the training prompts with their plain and pirate answers)."""

    def __init__(self, base_model, tokenizer, plan: Plan, items: list[dict], distillation: Distillation | None):
        self.base_model, self.tokenizer, self.plan = base_model, tokenizer, plan
        self.items, self.distillation = items, distillation

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
        args = _arguments(self.plan, arm, output_dir, self.learning_rate(arm))
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
        model = lora_model(model, factory.plan.lora_rank)
    trainer = factory.build(arm, model, [*protection(arm, anchors), *callbacks], output_dir)
    trainer.remove_callback(PrinterCallback)
    return trainer


def train_arm(arm: Arm, factory: TrainerFactory, anchors: dict, probe: Probe, output_dir: Path):
    """(trained model, curve points, {"train_seconds", "seconds_per_step"} without the measuring time, the
    logged training history)."""
    curve = CurveCallback(probe, factory.plan.measured_steps(arm.optimizer))
    trainer = prepared_trainer(arm, factory, anchors, [curve], output_dir)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start - curve.measuring
    timing = {"train_seconds": seconds, "seconds_per_step": seconds / factory.plan.steps_of(arm.optimizer)}
    return trainer.model, curve.points, timing, trainer.state.log_history
