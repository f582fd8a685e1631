"""Dependency noise a user can do nothing about, silenced when hf_cfp is imported (torch-free).

- DeepSpeed: accelerate and transformers import it whenever it is installed (to recognize its engine when
  unwrapping a model), and on a machine without a GPU its import logs "Setting accelerator to CPU. If you have
  GPU or other accelerator, we were unable to detect it." to stdout, in the middle of runs that do not use
  DeepSpeed. Dropped unless ACCELERATE_USE_DEEPSPEED=true.
- bitsandbytes (the `qlora` extra): on a CPU with AVX512-BF16 its import warns "Failed to load CPU
  gemm_4bit_forward from kernels-community: No module named 'kernels'..." (the `kernels` package would download
  a kernel from the Hub) and then uses its own bundled kernel. Dropped.
- TRL's DPO trainer reads `model.is_gradient_checkpointing`, which transformers 5 deprecates with a FutureWarning
  at every step: ignored while an `hf-cfp` command runs (`silence_known_warnings`), where the user cannot change
  TRL's code; a script of one's own keeps Python's defaults.
"""

import logging
import os
import warnings
from collections.abc import Callable


class KnownNote(logging.Filter):
    """A filter dropping the records whose message starts with `prefix`, unless `keep()` says this run wants
    them; every other record passes. Installed before the library logs: a logger's filters stay when the
    library later adds its own handler to it."""

    def __init__(self, prefix: str, keep: Callable[[], bool] = lambda: False):
        super().__init__()
        self.prefix, self.keep = prefix, keep

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix) or self.keep()


# logger name -> what is dropped from it
KNOWN_NOTES = {
    "DeepSpeed": KnownNote(
        "Setting accelerator to CPU.", keep=lambda: os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true"
    ),
    "bitsandbytes.backends.cpu.ops": KnownNote("Failed to load CPU gemm_4bit_forward from kernels-community"),
}


def silence_known_notes() -> None:
    """Install each of `KNOWN_NOTES` on its logger, once."""
    for logger_name, note in KNOWN_NOTES.items():
        logger = logging.getLogger(logger_name)
        if note not in logger.filters:
            logger.addFilter(note)


# FutureWarnings that dependencies trigger in each other, as a message regex
KNOWN_WARNINGS = [r"`is_gradient_checkpointing` is deprecated"]


def silence_known_warnings() -> None:
    """Ignore each of `KNOWN_WARNINGS` (FutureWarning) in this process: called by the `hf-cfp` commands."""
    for message in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)
