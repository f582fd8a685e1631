"""Bind an anchor to a live model: match canonical names, check shapes, move F to each device.

Under DDP every process holds full parameters and binds the full F. Under FSDP2, FSDP1 and
ZeRO-3 a process holds a piece of a parameter (`hf_cfp.parallel.shards`): it binds the slice
of F at the same offsets, and corrects and measures that piece alone. From an anchor kept in its
files (`FisherAnchor.from_pretrained(..., lazy=True)`) only those slices are read.
"""

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from transformers.utils import logging

from ..anchor import FisherAnchor
from ..errors import AnchorMismatchError
from ..geometry.diagonal.artifact import fisher_shape, read_block, read_flat
from ..names import canonical_name
from ..parallel.fsdp1 import FlatPiece
from ..parallel.processes import log_on_main_process
from ..parallel.shards import dtensor_flat_range, dtensor_local_block, held_pieces
from ..quantized import logical_shape

logger = logging.get_logger(__name__)


@dataclass(frozen=True)
class HeldRange:
    """Elements [start, stop) of the row-major flattened full parameter (`numel` elements) that this
    process holds; None bounds when its part is not one contiguous run (a DTensor split on a later dim)."""

    start: int | None
    stop: int | None
    numel: int


@dataclass
class BoundTensor:
    """One anchor tensor matched to the trainable model parameter it describes."""

    name: str
    param: torch.Tensor  # a Parameter, or a view into an FSDP1 flat shard
    fisher: torch.Tensor  # as `store` keeps it (default float32 on the parameter's device); sharded: the local part
    sharded: bool  # split across processes: sums over it are added across processes
    held: HeldRange  # which elements of the full parameter this process holds


def float32_beside(fisher: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """F in float32 on the parameter's device (the default `store` of `bind_anchor`)."""
    return fisher.to(device=param.device, dtype=torch.float32)


def bind_anchor(
    anchor: FisherAnchor,
    model: torch.nn.Module,
    names: dict[str, torch.Tensor] | None = None,
    store: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = float32_beside,
) -> list[BoundTensor]:
    """Match every tensor of `anchor.fisher` to a parameter of `model` by canonical name.

    `names` adds names -> parameters the model does not give itself: a PeftModel's base-model names
    (`peft_adapters.PeftView.params`), which take precedence. `store(F, param)` returns F as kept (dtype and
    device, `memory.MemoryPlan.store_fisher`).

    Raises AnchorMismatchError naming the parameter when a name is missing or a shape differs (a weight
    quantized by bitsandbytes, frozen under QLoRA, is compared by its logical shape: `quantized`).
    A tied parameter is bound once, under the first of its names found in the anchor. Frozen
    parameters never move, so they are skipped (one log line says which). A sharded parameter
    (FSDP2 DTensor, FSDP1 piece, ZeRO-3 partition) gets only the slice of F matching its local part.
    """
    bound: list[BoundTensor] = []
    for name, param, piece in matched_parameters(anchor, list(anchor.fisher), model, names, _check_shape):
        shape = tuple(piece.shape if piece else logical_shape(param))
        fisher, sharded, held = _held_part(anchor.fisher, name, param, piece, math.prod(shape))
        bound.append(BoundTensor(name, param, store(fisher, param), sharded, held))
    return bound


def _check_shape(anchor: FisherAnchor, name: str, param: torch.Tensor, piece: FlatPiece | None) -> None:
    shape = tuple(piece.shape if piece else logical_shape(param))  # a 4-bit weight's own shape is packed
    anchor_shape = tuple(fisher_shape(anchor.fisher, name))
    if anchor_shape != shape:
        raise AnchorMismatchError(
            f"Anchor {anchor.name!r}: parameter {name!r} has shape {anchor_shape} in the anchor "
            f"but {shape} in the model. Was the anchor computed for another model?"
        )


CheckShape = Callable[[FisherAnchor, str, torch.Tensor, "FlatPiece | None"], None]


def matched_parameters(
    anchor: FisherAnchor,
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


def _held_part(
    fisher: Mapping[str, torch.Tensor], name: str, param: torch.Tensor, piece: FlatPiece | None, numel: int
) -> tuple[torch.Tensor, bool, HeldRange]:
    """(F of the part of parameter `name` this process holds, whether it is sharded, which elements it is): an
    FSDP1 / ZeRO-3 piece's flat run, a DTensor's local block, else the whole. Only that part of F is read (from
    the files when the anchor is lazy)."""
    if piece is not None:
        return read_flat(fisher, name, piece.start, piece.stop), True, HeldRange(piece.start, piece.stop, numel)
    if isinstance(param, DTensor):
        start, stop = dtensor_flat_range(param) or (None, None)
        offsets, lengths, sharded = dtensor_local_block(name, param)
        return read_block(fisher, name, offsets, lengths), sharded, HeldRange(start, stop, numel)
    return fisher[name], False, HeldRange(0, numel, numel)
