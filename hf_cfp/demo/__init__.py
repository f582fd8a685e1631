"""The demo and what it needs: bundled calibration and task data, offline model loading (the
embedded SmolLM2-135M, a local directory or GGUF file, a tiny random Llama).

`run_demo` and `load_embedded_model` are imported on first use (module `__getattr__`), so that
`hf_cfp.demo.bundled` (data only) can be read without torch, as `hf-cfp --help` does.
"""

from typing import TYPE_CHECKING

from ..exports import lazy_exports

if TYPE_CHECKING:  # what the lazy names resolve to, for type checkers
    from .models import load_embedded_model
    from .run import run_demo


__getattr__, __dir__ = lazy_exports(__name__, {"load_embedded_model": "models", "run_demo": "run"})

__all__ = ["load_embedded_model", "run_demo"]
