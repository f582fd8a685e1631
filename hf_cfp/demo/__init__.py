"""The demo command (`hf-cfp demo`): estimate a math anchor, fine-tune with and without CFP, report drift and
held-out math (`run`, `capability`, `plot`). What it loads comes from `hf_cfp.loading`.

`run_demo` is imported on first use (module `__getattr__`), so that importing the package loads no torch.
"""

from typing import TYPE_CHECKING

from ..exports import lazy_exports

if TYPE_CHECKING:  # what the lazy name resolves to, for type checkers
    from .run import run_demo


__getattr__, __dir__ = lazy_exports(__name__, {"run_demo": "run"})

__all__ = ["run_demo"]
