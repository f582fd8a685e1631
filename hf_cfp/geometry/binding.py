"""What every geometry's binding shares: an anchor's parameter names matched to the parameters a live model trains
(canonical names, tied aliases, FSDP1 flat views, a PeftModel's base-model names), and which elements of a full
parameter this process holds (`HeldRange`). Each geometry binds what it keeps of its tensors on top of this
(`diagonal.binding`: F's local part; `kronecker.binding`: the eigenbases, U_G's local rows).
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from transformers.utils import logging

from ..errors import AnchorMismatchError
from ..names import canonical_name
from ..parallel.fsdp1 import FlatPiece
from ..parallel.processes import log_on_main_process
from ..parallel.shards import held_pieces
from .base import NamedFisher

logger = logging.get_logger(__name__)


@dataclass(frozen=True)
class HeldRange:
    """Elements [start, stop) of the row-major flattened full parameter (`numel` elements) that this
    process holds; None bounds when its part is not one contiguous run (a DTensor split on a later dim)."""

    start: int | None
    stop: int | None
    numel: int


CheckShape = Callable[[NamedFisher, str, torch.Tensor, "FlatPiece | None"], None]


def matched_parameters(
    anchor: NamedFisher,
    wanted: list[str],
    model: torch.nn.Module,
    names: Mapping[str, torch.Tensor] | None,
    check: CheckShape,
) -> list[tuple[str, torch.Tensor, FlatPiece | None]]:
    """(name, parameter, its held flat piece or None) of every name in `wanted` (an anchor's parameter names, in
    its order) that the model trains, each parameter once (a tied one under the first of its names); `check`
    raises for a shape that does not fit. Frozen parameters never move: they are skipped, one log line says which.

    Raises:
        AnchorMismatchError: a name the model does not have (or `check`'s).
    """
    by_name, pieces = parameters_by_name(model, dict(names) if names else None)
    matched, seen, frozen = [], set(), []
    for name in wanted:
        param = by_name.get(name)
        if param is None:
            raise AnchorMismatchError(
                f"Anchor {anchor.name!r} has parameter {name!r}, which the model does not have. "
                f"Was the anchor computed for another model? (The model's first parameter is "
                f"{next(iter(by_name), '<none>')!r}.)"
            )
        piece = pieces.get(id(param))
        check(anchor, name, param, piece)
        if not (piece.trainable if piece else param.requires_grad):
            frozen.append(name)
        elif id(param) not in seen:
            seen.add(id(param))
            matched.append((name, param, piece))
    if frozen:
        log_on_main_process(
            logger.info, "Anchor %r: %d frozen parameters left alone (e.g. %s).", anchor.name, len(frozen), frozen[0]
        )
    return matched


def parameters_by_name(
    model: torch.nn.Module, names: dict[str, torch.Tensor] | None
) -> tuple[dict[str, torch.Tensor], dict[int, FlatPiece]]:
    """(every canonical name, tied aliases included, -> the parameter standing there: FSDP1 flat views by their
    original names, `names` taking precedence; id(tensor) -> its held piece, `parallel.shards.held_pieces`)."""
    by_name: dict[str, torch.Tensor] = {}
    for alias, parameter in model.named_parameters(remove_duplicate=False):
        by_name.setdefault(canonical_name(alias), parameter)
    flat_views, pieces = held_pieces(model)
    by_name.update(flat_views)
    if names:
        by_name = {**names, **{n: p for n, p in by_name.items() if n not in names}}
    return by_name, pieces
