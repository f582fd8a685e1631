"""What the command line, the launcher and the demo load: causal LMs (`models`: a local directory, a GGUF file,
the embedded SmolLM2-135M, a Hub model id resolved through the cache (`hub_models`), a tiny random Llama and
tokenizer built in memory), the bundled prompt and task sets (`prompts`, with `data/`), and SFT examples made from
(prompt, response) pairs (`examples`).

`load_embedded_model` is imported on first use (module `__getattr__`), so that `hf_cfp.loading.prompts` (data
only) can be read without torch, as `hf-cfp --help` does.
"""

from typing import TYPE_CHECKING

from ..exports import lazy_exports

if TYPE_CHECKING:  # what the lazy names resolve to, for type checkers
    from .models import load_embedded_model


__getattr__, __dir__ = lazy_exports(__name__, {"load_embedded_model": "models"})

__all__ = ["load_embedded_model"]
