"""The diagonal geometry's binding: an anchor's F matched to a live model (canonical names, shapes), each process's
part of it moved to its device.

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

from ...errors import AnchorMismatchError
from ...parallel.fsdp1 import FlatPiece
from ...parallel.shards import dtensor_flat_range, dtensor_local_block
from ...quantized import logical_shape
from ..base import NamedFisher
from ..binding import HeldRange, matched_parameters
from .artifact import fisher_shape, read_block, read_flat


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
    anchor: NamedFisher,
    model: torch.nn.Module,
    names: dict[str, torch.Tensor] | None = None,
    store: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = float32_beside,
) -> list[BoundTensor]:
    """Match every tensor of `anchor.fisher` to a parameter of `model` by canonical name.

    `names` adds names -> parameters the model does not give itself: a PeftModel's base-model names
    (`protection.peft_adapters.PeftView.params`), which take precedence. `store(F, param)` returns F as kept (dtype and
    device, `protection.memory.MemoryPlan.store_fisher`).

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


def _check_shape(anchor: NamedFisher, name: str, param: torch.Tensor, piece: FlatPiece | None) -> None:
    shape = tuple(piece.shape if piece else logical_shape(param))  # a 4-bit weight's own shape is packed
    anchor_shape = tuple(fisher_shape(anchor.fisher, name))
    if anchor_shape != shape:
        raise AnchorMismatchError(
            f"Anchor {anchor.name!r}: parameter {name!r} has shape {anchor_shape} in the anchor "
            f"but {shape} in the model. Was the anchor computed for another model?"
        )


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
