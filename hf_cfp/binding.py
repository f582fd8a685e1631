"""Bind an anchor to a live model: match canonical names, check shapes, move F to each device.

Under DDP every process holds full parameters and binds the full F. Under FSDP2 (`fully_shard`)
a parameter is a DTensor sharded on dim 0: a process owns its local shard only, so it binds the
slice of F at the same offsets, and corrects and measures that shard alone.
"""

import logging
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from .distributed import process_rank_and_count
from .errors import AnchorMismatchError
from .fsdp1 import flat_parameters, flat_pieces
from .names import canonical_name
from .zero import zero3_pieces

logger = logging.getLogger(__name__)


@dataclass
class BoundTensor:
    """One anchor tensor matched to the trainable model parameter it describes."""

    name: str
    param: torch.nn.Parameter
    fisher: torch.Tensor  # float32, on the parameter's device; for a DTensor, its local shard only
    sharded: bool  # a DTensor split across processes: sums over it are added across processes


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    """What this process holds and updates of `param`: a DTensor's local shard, else `param` itself.

    Resolved at each use, not cached: FSDP2 may replace a shard's tensor at its lazy init.
    """
    if hasattr(param, "ds_tensor"):  # DeepSpeed ZeRO-3: this process's partition (hf_cfp/zero.py)
        from .zero import local_partition

        return local_partition(param)
    return param._local_tensor if isinstance(param, DTensor) else param


def _local_fisher(name: str, fisher: torch.Tensor, param: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(F restricted to this process's part of `param`, whether `param` is sharded across processes).

    For a DTensor: the slice F[o_0 : o_0 + n_0, o_1 : o_1 + n_1, ...] with the local shard's shape n
    and global offset o, copied so that only the shard's memory is kept.
    """
    if not isinstance(param, DTensor):
        return fisher, False
    placements, mesh = tuple(param.placements), param.device_mesh
    sharded = any(pl.is_shard() for pl in placements)
    if sharded and (mesh.size() != process_rank_and_count()[1] or not all(pl.is_shard() for pl in placements)):
        raise AnchorMismatchError(
            f"Parameter {name!r} is a DTensor with placements {placements} on a mesh of {mesh.size()} "
            f"processes: CFP supports parameters sharded over all processes (FSDP2 `fully_shard` on a 1-D "
            f"mesh), not replicated shards (HSDP) or sub-meshes. Shard over one mesh dimension spanning "
            f"every process, or use DDP."
        )
    shape, offset = compute_local_shape_and_global_offset(param.shape, mesh, placements)
    for dim, (start, length) in enumerate(zip(offset, shape)):
        fisher = fisher.narrow(dim, start, length)
    return fisher.clone(), sharded


def bind_anchor(anchor, model: torch.nn.Module) -> list[BoundTensor]:
    """Match every tensor of `anchor.fisher` to a parameter of `model` by canonical name.

    Raises AnchorMismatchError naming the parameter when a name is missing or a shape differs.
    A tied parameter is bound once, under the first of its names found in the anchor. Frozen
    parameters never move, so they are skipped (one log line says which). A sharded parameter
    (FSDP2 DTensor, FSDP1 piece, ZeRO-3 partition) gets only the slice of F matching its local part.
    """
    by_name = {}  # every canonical name, tied aliases included -> parameter
    for name, param in model.named_parameters(remove_duplicate=False):
        by_name.setdefault(canonical_name(name), param)
    bound, seen, frozen = [], set(), []
    pieces = flat_pieces(model)  # FSDP1 (use_orig_params): a parameter is a 1-D view of its piece
    pieces.update(zero3_pieces(model))  # DeepSpeed ZeRO-3: a parameter's data is its partition
    for name, (view, piece) in flat_parameters(model).items():  # FSDP1 flat: a view into the local shard
        by_name[name] = view
        pieces[id(view)] = piece
    for name, fisher in anchor.fisher.items():
        param = by_name.get(name)
        if param is None:
            raise AnchorMismatchError(
                f"Anchor {anchor.name!r} has parameter {name!r}, which the model does not have. "
                f"Was the anchor computed for another model? (The model's first parameter is "
                f"{next(iter(by_name), '<none>')!r}.)"
            )
        piece = pieces.get(id(param))
        if tuple(fisher.shape) != tuple(piece.shape if piece else param.shape):
            raise AnchorMismatchError(
                f"Anchor {anchor.name!r}: parameter {name!r} has shape {tuple(fisher.shape)} in the anchor "
                f"but {tuple(piece.shape if piece else param.shape)} in the model. Was the anchor computed "
                f"for another model?"
            )
        if not (piece.trainable if piece else param.requires_grad):
            frozen.append(name)
        elif id(param) not in seen:
            seen.add(id(param))
            fisher, sharded = (piece.fisher(fisher), True) if piece else _local_fisher(name, fisher, param)
            bound.append(BoundTensor(name, param, fisher.to(device=param.device, dtype=torch.float32), sharded))
    if frozen:
        logger.info("Anchor %r: %d frozen parameters left alone (e.g. %s).", anchor.name, len(frozen), frozen[0])
    return bound
