"""One arm of the evidence experiment: train a copy of the base model with the arm's optimizer and method,
and read the Fisher-weighted drift of every domain's anchor at the last step.

Every arm is watched by a `CFPCallback` over the math, code and safety anchors (lam = 0 where the arm's method
is not CFP, so it only measures): `DtFD_d = sensitive_drift_d^2 = sum_i F_d,i Delta_i^2` over the top-Fisher
(1 - free_fraction) coordinates of anchor d, at the final step.
"""

import copy
from pathlib import Path

from datasets import Dataset
from transformers import PrinterCallback, Trainer, TrainingArguments
from trl import DPOConfig, DPOTrainer

from hf_cfp.anchor import FisherAnchor
from hf_cfp.integrations import CFPCallback
from hf_cfp.loading.examples import sft_examples
from hf_cfp.loading.prompts import pirate_preference_triples, pirate_style_pairs
from hf_cfp.names import SENSITIVE_DRIFT, TOTAL_DRIFT

from .controls import KLPenaltySFTTrainer, StepOnlyCallback
from .plan import DOMAINS, Arm, Plan


def lam_of(anchor: FisherAnchor, strength: float) -> float:
    """lam = c / p99(F): c = `strength`, p99 the 99th percentile of the anchor's F (README, "Choosing lam")."""
    return strength / anchor.metadata["statistics"]["p99"]


def arm_callbacks(arm: Arm, anchors: dict[str, FisherAnchor]) -> list:
    """The arm's method as callbacks, each run measured on the math, code and safety anchors. `anchors` holds
    those three, `"isotropic"` (`isotropic_anchor` of math) and any quality anchors (`Plan.quality_anchors`)."""
    measured = [anchors[d] for d in DOMAINS]
    if arm.method in ("unregularized", "kl"):
        return [CFPCallback(measured[0], lam=0.0, monitor=measured[1:])]
    assert arm.anchor is not None, arm
    if arm.method == "step_only":
        step_only = StepOnlyCallback(anchors[arm.anchor], lam_of(anchors[arm.anchor], arm.strength))
        return [step_only, CFPCallback(measured[0], lam=0.0, monitor=measured[1:])]
    if arm.method == "budget":
        protecting = anchors[arm.anchor]
        return [CFPCallback(protecting, kl_budget=arm.strength, monitor=[a for a in measured if a is not protecting])]
    # cfp / isotropic: lam from the protecting anchor's own p99 (isotropic: math's, the same lam without shape)
    protecting = anchors["isotropic"] if arm.method == "isotropic" else anchors[arm.anchor]
    lam = lam_of(anchors[arm.anchor], arm.strength)
    return [CFPCallback(protecting, lam=lam, monitor=[a for a in measured if a.name != protecting.name])]


def _common_args(plan: Plan, arm: Arm, output_dir: Path) -> dict:
    return {
        "output_dir": str(output_dir),
        "max_steps": plan.steps,
        "per_device_train_batch_size": plan.batch_size if arm.optimizer == "sft" else plan.dpo_batch_size,
        "lr_scheduler_type": "constant",
        "logging_steps": max(1, plan.steps // 3),
        "save_strategy": "no",
        "report_to": "none",
        "use_cpu": True,
        "seed": arm.seed,
        "disable_tqdm": True,
    }


def _sft_trainer(arm, model, base_model, tokenizer, plan, callbacks, output_dir) -> Trainer:
    args = TrainingArguments(**_common_args(plan, arm, output_dir), learning_rate=plan.sft_learning_rate)
    dataset = sft_examples(tokenizer, pirate_style_pairs())
    if arm.method == "kl":
        return KLPenaltySFTTrainer(
            model=model,
            args=args,
            train_dataset=dataset,
            callbacks=callbacks,
            ref_model=base_model,
            kl_beta=arm.strength,
        )
    return Trainer(model=model, args=args, train_dataset=dataset, callbacks=callbacks)


def _dpo_trainer(arm, model, base_model, tokenizer, plan, callbacks, output_dir) -> DPOTrainer:
    beta = arm.strength if arm.method == "kl" else plan.dpo_beta
    args = DPOConfig(
        **_common_args(plan, arm, output_dir),
        learning_rate=plan.dpo_learning_rate,
        beta=beta,
        bf16=False,
        gradient_checkpointing=False,
    )
    triples = pirate_preference_triples()
    dataset = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": p}] for p, _, _ in triples],
            "chosen": [[{"role": "assistant", "content": c}] for _, c, _ in triples],
            "rejected": [[{"role": "assistant", "content": r}] for _, _, r in triples],
        }
    )
    return DPOTrainer(
        model=model,
        # a copy: accelerate's prepare_model sets an instance `forward` wrapper on the reference, and deep
        # copies of a model carrying it keep calling the original's forward (later arms would not train)
        ref_model=copy.deepcopy(base_model),
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=callbacks,
    )


def train_arm(arm: Arm, base_model, tokenizer, anchors: dict[str, FisherAnchor], plan: Plan, output_dir: Path):
    """(trained copy of `base_model`, {"<domain>/dtfd": DtFD at the last step, "loss": last logged loss})."""
    model = copy.deepcopy(base_model).train()
    callbacks = arm_callbacks(arm, anchors)
    build = _sft_trainer if arm.optimizer == "sft" else _dpo_trainer
    trainer = build(arm, model, base_model, tokenizer, plan, callbacks, output_dir)
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    last = [row for row in trainer.state.log_history if TOTAL_DRIFT.key() in row][-1]
    drift = {f"{d}/dtfd": last[SENSITIVE_DRIFT.key(d)] ** 2 for d in DOMAINS}
    return model, {**drift, "loss": last.get("loss", float("nan")), "total_drift": last[TOTAL_DRIFT.key()]}
