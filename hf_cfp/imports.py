"""The one place optional packages are probed (as accelerate's `utils/imports.py`): `is_<package>_available()`,
each cached, located with `importlib.util.find_spec` (found, not imported: nothing loads, nothing runs), and
`require`, the error a feature raises when one it needs is missing.

The core install (torch, transformers, accelerate, huggingface-hub, safetensors, tokenizers, tqdm, psutil) is
enough for `CFPCallback` on a plain `Trainer`, the loop API, anchors and the Hub. The extras:

    trl        trl, datasets   `hf-cfp train`, TRL trainers' examples, the scripts' evidence
    peft       peft            LoRA (binding a `PeftModel`; `hf-cfp demo --peft`)
    qlora      peft, bitsandbytes
    deepspeed  deepspeed
    demo       gguf, matplotlib, peft  `hf-cfp demo` on the embedded GGUF model, its plot, `--peft`

A module never needs to probe for peft, deepspeed or bitsandbytes to handle their objects: a `PeftModel` (a
DeepSpeed engine, a quantized weight) can exist only once its package was imported, so code that meets one
looks at `sys.modules` instead (`protection.peft_adapters`, `quantized`).
"""

import functools
import importlib.util

from .errors import CFPError

# optional package -> the extra that installs it
EXTRA_OF = {
    "trl": "trl",
    "datasets": "trl",
    "peft": "peft",
    "bitsandbytes": "qlora",
    "deepspeed": "deepspeed",
    "matplotlib": "demo",
    "gguf": "demo",
}


@functools.cache
def is_available(package: str) -> bool:
    """Whether `package` can be imported here (located by `importlib.util.find_spec`, not imported)."""
    return importlib.util.find_spec(package) is not None


def is_trl_available() -> bool:
    """Whether trl is installed (the `trl` extra)."""
    return is_available("trl")


def is_datasets_available() -> bool:
    """Whether datasets is installed (the `trl` extra)."""
    return is_available("datasets")


def is_peft_available() -> bool:
    """Whether peft is installed (the `peft` extra)."""
    return is_available("peft")


def is_deepspeed_available() -> bool:
    """Whether deepspeed is installed (the `deepspeed` extra)."""
    return is_available("deepspeed")


def is_bitsandbytes_available() -> bool:
    """Whether bitsandbytes is installed (the `qlora` extra)."""
    return is_available("bitsandbytes")


def is_matplotlib_available() -> bool:
    """Whether matplotlib is installed (the `demo` extra)."""
    return is_available("matplotlib")


def is_gguf_available() -> bool:
    """Whether gguf is installed (the `demo` extra)."""
    return is_available("gguf")


def require(what: str, *packages: str) -> None:
    """Raise CFPError naming `what` needs, the packages of `packages` that are not installed and the extra that
    installs them (`pip install 'hf-cfp[<extra>]'`); nothing when all are installed.

    Example: `require("hf-cfp train", "trl", "datasets")`.
    """
    missing = [package for package in packages if not is_available(package)]
    if missing:
        extras = ",".join(dict.fromkeys(EXTRA_OF[package] for package in missing))
        raise CFPError(
            f"{what} needs {' and '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not installed: "
            f"run `pip install 'hf-cfp[{extras}]'`."
        )
