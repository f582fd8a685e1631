"""Canonical parameter names: what `model.named_parameters()` gives once wrappers are removed."""

import re
from collections.abc import Iterator

import torch

# Prefixes added by wrappers: DDP/DataParallel (`module.`), torch.compile (`_orig_mod.`),
# FSDP (`_fsdp_wrapped_module.`) and activation checkpointing (`_checkpoint_wrapped_module.`).
_WRAPPER_PARTS = ("module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")
_WRAPPER_PREFIX = re.compile(r"^(?:(?:" + "|".join(_WRAPPER_PARTS) + r")\.)+")
_INNER_WRAPPER = re.compile(r"\.(?:_orig_mod|_fsdp_wrapped_module|_checkpoint_wrapped_module)(?=\.)")


def canonical_name(name: str) -> str:
    """Strip wrapper prefixes: `module._orig_mod.model.layers.0.mlp` -> `model.layers.0.mlp`."""
    return _INNER_WRAPPER.sub("", _WRAPPER_PREFIX.sub("", name))


def named_parameters_once(model: torch.nn.Module, *, trainable_only: bool) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """`(canonical_name, parameter)` pairs, every parameter once: a tied parameter appears under its
    first name only. `trainable_only=True` skips parameters with `requires_grad=False`."""
    seen = set()
    for name, param in model.named_parameters():
        if id(param) in seen or (trainable_only and not param.requires_grad):
            continue
        seen.add(id(param))
        yield canonical_name(name), param
