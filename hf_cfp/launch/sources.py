"""What `hf-cfp train` trains on, built the way TRL's `trl sft|dpo|grpo` scripts build it: the dataset (a Hub id, a
local directory, or a `.jsonl` / `.json` / `.parquet` file) and the model (a name TRL loads, or the embedded
SmolLM2-135M / a `.gguf` file loaded here)."""

from pathlib import Path
from typing import Any

import torch
from datasets import DatasetDict, IterableDatasetDict, load_dataset
from trl import ModelConfig, ScriptArguments

from ..errors import CFPArgumentError
from ..loading.models import EMBEDDED, load_causal_lm

# local data files and the `datasets` builder that reads them
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def check_dataset_source(script_args: ScriptArguments) -> None:
    """`dataset_name` is given, and a data file it names exists (checked before anything is loaded).

    Raises:
        CFPArgumentError: no `dataset_name`, or a `.jsonl` / `.json` / `.parquet` path with no file there.
    """
    name = script_args.dataset_name
    if not name:
        raise CFPArgumentError(
            "dataset_name is required: a Hub dataset id, a local dataset directory, or a .jsonl/.json/.parquet file."
        )
    if Path(name).suffix in FILE_BUILDERS and not Path(name).is_file():
        raise CFPArgumentError(f"dataset_name: no file at {name!r} (paths are relative to {Path.cwd()}).")


def load_splits(script_args: ScriptArguments) -> DatasetDict | IterableDatasetDict:
    """The dataset's splits: a data file through the `json` / `parquet` builder (one split, `train`), anything else
    through `load_dataset(dataset_name, name=dataset_config, streaming=dataset_streaming)` as `trl sft` does.
    A `response` column beside `prompt` is renamed `completion` (TRL's prompt-completion form; the bundled pairs
    `hf_cfp/loading/data/pirate_style.jsonl` use `response`)."""
    name = str(script_args.dataset_name)
    builder = FILE_BUILDERS.get(Path(name).suffix)
    if builder is not None:
        splits = load_dataset(builder, data_files=name, streaming=script_args.dataset_streaming)
    else:
        splits = load_dataset(name, name=script_args.dataset_config, streaming=script_args.dataset_streaming)
    columns = next(iter(splits.values())).column_names or []
    if {"prompt", "response"} <= set(columns) and "completion" not in columns:
        splits = splits.rename_column("response", "completion")
    return splits


def split(splits: DatasetDict | IterableDatasetDict, name: str, field: str) -> Any:
    """`splits[name]`, or CFPArgumentError naming the config field that chose it."""
    if name not in splits:
        raise CFPArgumentError(f"{field}: the dataset has no split {name!r}; it has {sorted(splits)}.")
    return splits[name]


def is_loaded_here(model_args: ModelConfig) -> bool:
    """Whether the launcher loads the model itself (the embedded model or a `.gguf` file, which TRL cannot load by
    name) rather than passing `model_name_or_path` to the trainer."""
    name = model_args.model_name_or_path
    return name == EMBEDDED or str(name).endswith(".gguf")


def load_model(model_args: ModelConfig, training_args: Any) -> tuple[Any, Any]:
    """(model, tokenizer) for the trainer. A model TRL can load by name is passed as the name, with TRL's
    `model_init_kwargs` (revision, trust_remote_code, attn_implementation, dtype) as `trl sft` sets them, and its
    tokenizer left to the trainer (None); the embedded model or a `.gguf` file is loaded here (de-quantized,
    float32, then cast to `dtype` unless it is "auto" or "float32").

    Raises:
        CFPArgumentError: no `model_name_or_path`.
    """
    name = model_args.model_name_or_path
    if not name:
        raise CFPArgumentError(
            f"model_name_or_path is required: a Hub model id, a local model directory, a .gguf file or {EMBEDDED!r}."
        )
    if is_loaded_here(model_args):
        model, tokenizer = load_causal_lm(name)
        if model_args.dtype not in (None, "auto", "float32"):
            model = model.to(getattr(torch, model_args.dtype))
        return model, tokenizer
    training_args.model_init_kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
        **(training_args.model_init_kwargs or {}),
    }
    return name, None


def reference_is_a_copy(kind: str, model_args: ModelConfig, training_args: Any) -> bool:
    """Whether the trainer needs `ref_model=copy.deepcopy(model)` (decided before the model is loaded). For a model
    loaded here, TRL would rebuild the reference from the model's config name, which names no loadable model: DPO
    then gets a copy of the model (unless PEFT's disabled adapters or precomputed log-probs serve as the reference);
    GRPO with `beta > 0` has no `ref_model` argument and is refused.

    Raises:
        CFPArgumentError: GRPO with beta > 0 on a model loaded here (without PEFT).
    """
    if not is_loaded_here(model_args) or model_args.use_peft:
        return False
    if kind == "grpo" and training_args.beta > 0:
        raise CFPArgumentError(
            f"beta > 0 with model_name_or_path {model_args.model_name_or_path!r}: GRPOTrainer loads its reference "
            "model by name, which this model has not. Save it to a directory (model.save_pretrained and "
            "tokenizer.save_pretrained) and give that directory, or use --use_peft, or beta: 0.0."
        )
    return kind == "dpo" and not training_args.precompute_ref_log_probs
