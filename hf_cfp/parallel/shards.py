"""What this process holds of each parameter, under every layout CFP supports.

- plain / DDP: the whole parameter;
- FSDP2 (`fully_shard`): a DTensor sharded on dim 0, of which this process holds the local shard;
- FSDP1 with `use_orig_params=True`: a 1-D view of elements [start, stop) of the flattened
  parameter (a `FlatPiece`); with `use_orig_params=False`: a view into the local FlatParameter
  shard, bound under the original name;
- DeepSpeed ZeRO-3: the partition `ds_tensor`, elements [start, start + numel) of the flattened
  parameter.

Binding reads F at the same elements, so correction and drift run on local pieces only.
"""

import math

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..errors import AnchorMismatchError
from .deepspeed import local_partition, zero3_pieces
from .fsdp1 import FlatPiece, flat_parameters, flat_pieces
from .processes import process_rank_and_count


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    """What this process holds and updates of `param`: a ZeRO-3 partition, a DTensor's local shard,
    else `param` itself. Resolved at each use, not cached: FSDP2 may replace a shard's tensor at
    its lazy init, and ZeRO-3 re-partitions."""
    if hasattr(param, "ds_tensor"):
        return local_partition(param)
    return param._local_tensor if isinstance(param, DTensor) else param


def held_pieces(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[int, FlatPiece]]:
    """(FSDP1 flat views by canonical original name, id(tensor) -> FlatPiece for every parameter or
    view of which this process holds a flat piece only: FSDP1 pieces and views, ZeRO-3 partitions).

    Raises CFPError for the FSDP1 layouts CFP cannot correct (`fsdp1.flat_pieces`).
    """
    pieces = flat_pieces(model)
    pieces.update(zero3_pieces(model))
    views = {}
    for name, (view, piece) in flat_parameters(model).items():
        views[name] = view
        pieces[id(view)] = piece
    return views, pieces


def dtensor_flat_range(param: DTensor) -> tuple[int, int] | None:
    """[start, stop): the elements of the row-major flattened full parameter that this process's
    shard of `param` holds, or None when the shard is not one contiguous run of them.

    With local shape n and global offset o, the shard is contiguous when every dimension before
    the first split one, i, is whole; then start = o_i * s_i and stop = (o_i + n_i) * s_i with
    s_i = prod(full_shape[i + 1:]), and every dimension after i must be whole too.
    """
    full = tuple(param.shape)
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, tuple(param.placements))
    split = [d for d, (n, size) in enumerate(zip(shape, full, strict=True)) if n != size]
    if not split:
        return 0, param.numel()
    first = split[0]
    if any(d != first for d in split):
        return None
    stride = math.prod(full[first + 1 :])
    return offset[first] * stride, (offset[first] + shape[first]) * stride


def dtensor_local_block(name: str, param: DTensor) -> tuple[list[int], list[int], bool]:
    """(global offsets o, local shape n, whether `param` is sharded): this process's shard of the DTensor
    `param` is the block full[o_0 : o_0 + n_0, o_1 : o_1 + n_1, ...], and binding reads that block of F.
    Refuses replicated shards (HSDP) and sub-meshes with AnchorMismatchError.
    """
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
    return list(offset), list(shape), sharded
