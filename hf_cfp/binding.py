"""Bind an anchor to a live model: match canonical names, check shapes, move F to each device."""

import logging
from dataclasses import dataclass

import torch

from .errors import AnchorMismatchError
from .names import canonical_name

logger = logging.getLogger(__name__)


@dataclass
class BoundTensor:
    """One anchor tensor matched to the trainable model parameter it describes."""

    name: str
    param: torch.nn.Parameter
    fisher: torch.Tensor  # float32, on the parameter's device


def bind_anchor(anchor, model: torch.nn.Module) -> list[BoundTensor]:
    """Match every tensor of `anchor.fisher` to a parameter of `model` by canonical name.

    Raises AnchorMismatchError naming the parameter when a name is missing or a shape differs.
    A tied parameter is bound once, under the first of its names found in the anchor. Frozen
    parameters never move, so they are skipped (one log line says which).
    """
    by_name = {}  # every canonical name, tied aliases included -> parameter
    for name, param in model.named_parameters(remove_duplicate=False):
        by_name.setdefault(canonical_name(name), param)
    bound, seen, frozen = [], set(), []
    for name, fisher in anchor.fisher.items():
        param = by_name.get(name)
        if param is None:
            raise AnchorMismatchError(
                f"Anchor {anchor.name!r} has parameter {name!r}, which the model does not have. "
                f"Was the anchor computed for another model? (The model's first parameter is "
                f"{next(iter(by_name), '<none>')!r}.)"
            )
        if tuple(fisher.shape) != tuple(param.shape):
            raise AnchorMismatchError(
                f"Anchor {anchor.name!r}: parameter {name!r} has shape {tuple(fisher.shape)} in the anchor "
                f"but {tuple(param.shape)} in the model. Was the anchor computed for another model?"
            )
        if not param.requires_grad:
            frozen.append(name)
        elif id(param) not in seen:
            seen.add(id(param))
            bound.append(BoundTensor(name, param, fisher.to(device=param.device, dtype=torch.float32)))
    if frozen:
        logger.info("Anchor %r: %d frozen parameters left alone (e.g. %s).", anchor.name, len(frozen), frozen[0])
    return bound
