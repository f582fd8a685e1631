"""One arm of the evidence experiment: train a copy of the base model with the arm's optimizer and method,
and read the Fisher-weighted drift of every domain's anchor at the last step.

Every arm is watched by a `CFPCallback` over the math, code and safety anchors (lam = 0 where the arm's method
is not CFP, so it only measures): `DtFD_d = sensitive_drift_d^2 = sum_i F_d,i Delta_i^2` under the diagonal
anchor d, at the final step. New arms (`plan.is_new`: K-FAC and RL) are also measured on the math K-FAC anchor:
`math/kfac_predicted_kl` = 0.5 sum_W tr(Delta_W^T G Delta_W A) + 0.5 sum_other F Delta^2 (its
`cfp/math_kfac/predicted_kl`), beside the diagonal `math/predicted_kl` = 0.5 DtFD_math.

Optimizers: SFT (transformers' Trainer on the pirate-style pairs), DPO (TRL, the pirate preference triples) and
RLOO (TRL's `RLOOTrainer`, `rloo-<reward>`: the pirate-style prompts, chat-formatted as for SFT and DPO,
`rl_generations` completions of at most `rl_completion_tokens` tokens per prompt, the leave-one-out baseline; its
KL arm subtracts beta * sum_t (log pi_theta - log pi_ref) of each completion from its reward, the reference being
the base model loaded from a local save, `saved_reference`).
"""

import copy
from pathlib import Path

from datasets import Dataset
from transformers import PrinterCallback, Trainer, TrainingArguments
from trl import DPOConfig, DPOTrainer, RLOOConfig, RLOOTrainer

from hf_cfp.anchor import FisherAnchor
from hf_cfp.integrations import CFPCallback
from hf_cfp.loading.examples import sft_examples
from hf_cfp.loading.prompts import pirate_preference_triples, pirate_style_pairs
from hf_cfp.names import PREDICTED_KL, SENSITIVE_DRIFT, TOTAL_DRIFT

from .controls import KLPenaltySFTTrainer, StepOnlyCallback, floats_per_param
from .plan import DOMAINS, KFAC_MONITOR, Arm, Plan, is_new, kfac_anchor_name, kfac_lam_anchor, rl_reward
from .rewards import REWARDS


def lam_of(anchor: FisherAnchor, strength: float) -> float:
    """lam = c / p99(F): c = `strength`, p99 the 99th percentile of the anchor's F (README, "Choosing lam")."""
    return strength / anchor.metadata["statistics"]["p99"]


def arm_callbacks(arm: Arm, anchors: dict[str, FisherAnchor]) -> list:
    """The arm's method as callbacks, each run measured on the math, code and safety anchors (and `KFAC_MONITOR`
    for new arms). `anchors` holds at least `Plan.anchors_of(arm)`."""
    measured = [anchors[d] for d in DOMAINS] + ([anchors[KFAC_MONITOR]] if is_new(arm) else [])
    if arm.method == "kfac":
        assert arm.anchor is not None, arm
        protecting = anchors[kfac_anchor_name(arm.anchor)]
        lam = lam_of(anchors[kfac_lam_anchor(arm.anchor)], arm.strength)
        return [CFPCallback(protecting, lam=lam, monitor=[a for a in measured if a.name != protecting.name])]
    if arm.method in ("unregularized", "kl"):
        return [CFPCallback(measured[0], lam=0.0, monitor=measured[1:])]
    assert arm.anchor is not None, arm
    if arm.method == "step_only":
        step_only = StepOnlyCallback(anchors[arm.anchor], lam_of(anchors[arm.anchor], arm.strength))
        return [step_only, CFPCallback(measured[0], lam=0.0, monitor=measured[1:])]
    if arm.method == "budget":
        protecting = anchors[arm.anchor]
        others = [a for a in measured if a is not protecting]
        return [CFPCallback(protecting, predicted_kl_budget=arm.strength, monitor=others)]
    # cfp / isotropic: lam from the protecting anchor's own p99 (isotropic: math's, the same lam without shape)
    protecting = anchors["isotropic"] if arm.method == "isotropic" else anchors[arm.anchor]
    lam = lam_of(anchors[arm.anchor], arm.strength)
    return [CFPCallback(protecting, lam=lam, monitor=[a for a in measured if a.name != protecting.name])]


def _common_args(plan: Plan, arm: Arm, output_dir: Path) -> dict:
    batch = {"sft": plan.batch_size, "dpo": plan.dpo_batch_size}.get(arm.optimizer, plan.rl_batch_size)
    return {
        "output_dir": str(output_dir),
        "max_steps": plan.steps,
        "per_device_train_batch_size": batch,
        "lr_scheduler_type": "constant",
        "logging_steps": plan.logging_steps(arm),
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


def saved_reference(base_model, directory: Path) -> Path:
    """`base_model` saved to `directory` (once): RLOO builds its KL reference by loading the policy's
    `config._name_or_path`, which a model built or loaded in memory does not have."""
    if not (directory / "config.json").exists():
        base_model.save_pretrained(directory)
    return directory


def _rl_trainer(arm, model, base_model, tokenizer, plan, callbacks, output_dir) -> RLOOTrainer:
    beta = arm.strength if arm.method == "kl" else 0.0
    if beta:
        model.config._name_or_path = str(saved_reference(base_model, output_dir / "reference"))
    args = RLOOConfig(
        **_common_args(plan, arm, output_dir),
        learning_rate=plan.rl_learning_rate,
        beta=beta,
        num_generations=plan.rl_generations,
        max_completion_length=plan.rl_completion_tokens,
        temperature=1.0,
        bf16=False,
        gradient_checkpointing=False,
    )
    prompts = [[{"role": "user", "content": p}] for p, _ in pirate_style_pairs()]
    return RLOOTrainer(
        model=model,
        reward_funcs=REWARDS[str(rl_reward(arm.optimizer))],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=copy.deepcopy(tokenizer),  # the trainer may set its padding side
        callbacks=callbacks,
    )


def train_arm(arm: Arm, base_model, tokenizer, anchors: dict[str, FisherAnchor], plan: Plan, output_dir: Path):
    """(trained copy of `base_model`, {"<domain>/dtfd": DtFD at the last step, "loss": last logged loss,
    "total_drift"; new arms also "math/predicted_kl" and "math/kfac_predicted_kl"; CFP-KFAC arms also
    "kfac/floats_per_param" of the protecting anchor and "kfac/full_floats_per_param" of the full anchor its lam
    comes from (`controls.floats_per_param`; equal at full rank)})."""
    model = copy.deepcopy(base_model).train()
    callbacks = arm_callbacks(arm, anchors)
    build = {"sft": _sft_trainer, "dpo": _dpo_trainer}.get(arm.optimizer, _rl_trainer)
    trainer = build(arm, model, base_model, tokenizer, plan, callbacks, output_dir)
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    last = [row for row in trainer.state.log_history if TOTAL_DRIFT.key() in row][-1]
    drift = {f"{d}/dtfd": last[SENSITIVE_DRIFT.key(d)] ** 2 for d in DOMAINS}
    if is_new(arm):
        drift["math/predicted_kl"] = last[PREDICTED_KL.key("math")]
        drift["math/kfac_predicted_kl"] = last[PREDICTED_KL.key(KFAC_MONITOR)]
    if arm.method == "kfac":  # what the protecting anchor stores, and the full anchor it may be cut from
        assert arm.anchor is not None, arm
        drift["kfac/floats_per_param"] = floats_per_param(anchors[kfac_anchor_name(arm.anchor)].kfac)
        drift["kfac/full_floats_per_param"] = floats_per_param(anchors[kfac_lam_anchor(arm.anchor)].kfac)
    return model, {**drift, "loss": last.get("loss", float("nan")), "total_drift": last[TOTAL_DRIFT.key()]}
