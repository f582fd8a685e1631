"""`hf-cfp train {sft,dpo,grpo} --config cfg.yaml [--key value ...]`: a TRL training script with CFP.

TRL's own parser (`TrlParser`) reads TRL's `ScriptArguments`, the trainer's config (`SFTConfig`, `DPOConfig`,
`GRPOConfig`), `ModelConfig` and [`CFPConfig`] from the YAML file and the command line (the command line wins), as
`trl sft|dpo|grpo` do. Then, in this order: the `cfp_*` fields, the dataset file, the reward functions and the
anchors are checked (the anchors loaded lazily), so that a bad value fails before the model loads; the dataset and
the model are loaded as TRL's scripts load them; the trainer is built with `callbacks=[CFPCallback(...)]` and
trained; the model, its tokenizer and `trainer_state.json` (the logged `cfp/*` metrics) are saved to `output_dir`.
Under `accelerate launch -m hf_cfp.cli train ...` every process runs this.
"""

import copy
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from trl import (
    DPOConfig,
    DPOTrainer,
    GRPOConfig,
    GRPOTrainer,
    ModelConfig,
    ScriptArguments,
    SFTConfig,
    SFTTrainer,
    TrlParser,
    get_peft_config,
    get_quantization_config,
)
from trl.scripts.grpo import GRPOScriptArguments

from ..errors import CFPArgumentError
from .config import CFPConfig
from .rewards import resolve_rewards
from .sources import check_dataset_source, load_model, load_splits, reference_is_a_copy, split


@dataclass(frozen=True)
class TrainerKind:
    """The script arguments, config and trainer classes of one `hf-cfp train` subcommand."""

    script_arguments: type
    config: type
    trainer: type


TRAINERS = {
    "sft": TrainerKind(ScriptArguments, SFTConfig, SFTTrainer),
    "dpo": TrainerKind(ScriptArguments, DPOConfig, DPOTrainer),
    "grpo": TrainerKind(GRPOScriptArguments, GRPOConfig, GRPOTrainer),
}


def make_parser(kind: str) -> TrlParser:
    """TRL's parser over (CFPConfig, script arguments, the trainer's config, ModelConfig) for `kind`; CFPConfig
    first, so that its checks run before those of TRL's configs."""
    classes = TRAINERS[kind]
    dataclass_types: list[Any] = [CFPConfig, classes.script_arguments, classes.config, ModelConfig]
    return TrlParser(dataclass_types, prog=f"hf-cfp train {kind}")


def parse_train_arguments(argv: Sequence[str]) -> tuple[str, Any, Any, ModelConfig, CFPConfig]:
    """(kind, script arguments, training config, model config, CFP config) from `argv` = `kind [--config cfg.yaml]
    [--key value ...]`: YAML values replace the defaults, command-line flags replace both. Unknown keys are errors.

    Raises:
        CFPArgumentError: no or an unknown trainer kind, or a bad `cfp_*` value (naming the field).
    """
    if not argv or argv[0] not in TRAINERS:
        raise CFPArgumentError(
            f"hf-cfp train needs the trainer first, one of {sorted(TRAINERS)}, got {list(argv[:1])}: e.g. "
            "`hf-cfp train dpo --config scripts/configs/dpo.yaml --cfp_lam 20`."
        )
    cfp_config, script_args, training_args, model_args = make_parser(argv[0]).parse_args_and_config(list(argv[1:]))
    return argv[0], script_args, training_args, model_args, cfp_config


def train_main(argv: Sequence[str] | None = None) -> Any:
    """Run `hf-cfp train {sft,dpo,grpo} --config cfg.yaml [--key value ...]` (`argv` without `hf-cfp train`;
    default `sys.argv[1:]`).

    Args:
        argv (`Sequence[str]`, *optional*): the trainer kind, then TRL-style arguments.

    Returns:
        The trained TRL trainer (its `state.log_history` holds the `cfp/*` metrics).

    Raises:
        CFPArgumentError: a bad or missing value (trainer kind, `cfp_*` field, dataset file, reward, model name),
            raised before the model is loaded.
        CFPError: an anchor that cannot be loaded (also before the model is loaded).
    """
    kind, script_args, training_args, model_args, cfp_config = parse_train_arguments(
        sys.argv[1:] if argv is None else argv
    )
    check_dataset_source(script_args)
    if kind == "grpo":
        extra: dict[str, Any] = {
            "reward_funcs": resolve_rewards(script_args.reward_funcs, script_args.reward_model_name_or_path)
        }
    else:
        extra = {}
    copy_reference = reference_is_a_copy(kind, model_args, training_args)
    callback = cfp_config.build_callback()  # anchors load (lazily) here: a missing one fails before the model
    splits = load_splits(script_args)
    model, tokenizer = load_model(model_args, training_args)
    if copy_reference:
        extra["ref_model"] = copy.deepcopy(model)
    if isinstance(model, str):  # TRL loads it, quantized if asked
        extra["quantization_config"] = get_quantization_config(model_args)
    trainer = TRAINERS[kind].trainer(
        model=model,
        args=training_args,
        train_dataset=split(splits, script_args.dataset_train_split, "dataset_train_split"),
        eval_dataset=(
            split(splits, script_args.dataset_test_split, "dataset_test_split")
            if training_args.eval_strategy != "no"
            else None
        ),
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
        callbacks=[callback],
        **extra,
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    trainer.save_state()  # trainer_state.json in output_dir: the log history with the cfp/* metrics
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    if hasattr(trainer, "end"):  # transformers >= 5.18: finish the trackers, destroy the process group
        trainer.end()
    return trainer
