"""Dependency noise a user can do nothing about, silenced when hf_cfp is imported (torch-free).

DeepSpeed: accelerate and transformers import it whenever it is installed (to recognize its engine when
unwrapping a model), and on a machine without a GPU its import logs "Setting accelerator to CPU. If you have GPU
or other accelerator, we were unable to detect it." to stdout, in the middle of runs that do not use DeepSpeed.
`CPUAcceleratorNote` drops that one line unless ACCELERATE_USE_DEEPSPEED=true.
"""

import logging
import os


class CPUAcceleratorNote(logging.Filter):
    """A filter on DeepSpeed's logger that drops its import-time "Setting accelerator to CPU." note outside
    DeepSpeed runs (ACCELERATE_USE_DEEPSPEED not "true"); every other record passes. Installed before deepspeed is
    imported: a logger's filters stay when DeepSpeed later adds its stdout handler to it."""

    def filter(self, record: logging.LogRecord) -> bool:
        note = record.getMessage().startswith("Setting accelerator to CPU.")
        return not note or os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true"


def silence_known_notes() -> None:
    """Install `CPUAcceleratorNote` on the "DeepSpeed" logger (the name deepspeed.utils.logging gives it), once."""
    deepspeed_logger = logging.getLogger("DeepSpeed")
    if not any(isinstance(f, CPUAcceleratorNote) for f in deepspeed_logger.filters):
        deepspeed_logger.addFilter(CPUAcceleratorNote())
