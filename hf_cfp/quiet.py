"""Dependency noise a user can do nothing about, silenced while an `hf-cfp` command runs (`known_noise_silenced`,
which `hf_cfp.cli.main` enters), and only then: importing hf_cfp touches no logger and no warning filter, and a
script of one's own keeps every library's defaults.

- DeepSpeed: accelerate and transformers import it whenever it is installed (to recognize its engine when
  unwrapping a model), and on a machine without a GPU its import logs "Setting accelerator to CPU. If you have
  GPU or other accelerator, we were unable to detect it." to stdout, in the middle of runs that do not use
  DeepSpeed. Dropped unless ACCELERATE_USE_DEEPSPEED=true.
- bitsandbytes (the `qlora` extra): on a CPU with AVX512-BF16 its import warns "Failed to load CPU
  gemm_4bit_forward from kernels-community: No module named 'kernels'..." (the `kernels` package would download
  a kernel from the Hub) and then uses its own bundled kernel. Dropped.
- TRL's DPO trainer reads `model.is_gradient_checkpointing`, which transformers 5 deprecates with a FutureWarning
  at every step, where the user cannot change TRL's code: ignored.
"""

import contextlib
import logging
import os
import warnings
from collections.abc import Callable, Iterator


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

# FutureWarnings that dependencies trigger in each other, as a message regex
KNOWN_WARNINGS = [r"`is_gradient_checkpointing` is deprecated"]


@contextlib.contextmanager
def known_noise_silenced() -> Iterator[None]:
    """While the block runs, each of `KNOWN_NOTES` filters its logger and each of `KNOWN_WARNINGS` (FutureWarning)
    is ignored; on the way out, however the block ends, the filters come off again and `warnings.filters` is
    restored as it was (`warnings.catch_warnings`)."""
    added = []
    for logger_name, note in KNOWN_NOTES.items():
        logger = logging.getLogger(logger_name)
        if note not in logger.filters:
            logger.addFilter(note)
            added.append((logger, note))
    try:
        with warnings.catch_warnings():
            for message in KNOWN_WARNINGS:
                warnings.filterwarnings("ignore", message=message, category=FutureWarning)
            yield
    finally:
        for logger, note in added:
            logger.removeFilter(note)
