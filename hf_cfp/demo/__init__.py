"""The demo and what it needs: bundled calibration and task data, offline model loading (the
embedded SmolLM2-135M, a local directory or GGUF file, a tiny random Llama).

`run_demo` is imported on first use (module `__getattr__`), so that `hf_cfp.demo.bundled` (data only) can be
read without torch, as `hf-cfp --help` does.
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what the lazy name resolves to, for type checkers
    from .run import run_demo


def __getattr__(name: str):
    """`hf_cfp.demo.run_demo`, imported from `.run` when first read."""
    if name != "run_demo":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return importlib.import_module(".run", __name__).run_demo


__all__ = ["run_demo"]
