"""FSDP1 (`FullyShardedDataParallel` with `use_orig_params=True`): which piece of each parameter a process holds.

FSDP1 flattens the parameters of each wrapped unit into one FlatParameter and gives every process
a contiguous slice of it. With `use_orig_params=True` each original parameter stays a Parameter,
but between forward passes its data is a 1-D view of this process's part of the flattened
parameter: elements [start, stop) of `param_full.reshape(-1)`, possibly empty. A process binds
the same piece of F, corrects that view in place (it writes through into the FlatParameter) and
adds its sums of squares to the other processes' ones, like FSDP2's shards.

With `use_orig_params=False` only the FlatParameters are visible. Each original parameter's piece
then lies at `offset_in_shard` in this process's (padded) shard of the FlatParameter: CFP binds, under
the original name, a 1-D view of those elements of the local shard (`flat_parameters`), corrects it
in place (the padding is never touched) and adds its sums of squares across processes likewise.

Hybrid sharding is refused.
"""

from dataclasses import dataclass

import torch
from torch.distributed.fsdp import FullyShardedDataParallel

from ..errors import CFPError
from ..names import canonical_name
from .processes import process_rank_and_count


@dataclass(frozen=True)
class FlatPiece:
    """This process's part of one original parameter under FSDP1: flat elements [start, stop)."""

    shape: torch.Size  # the parameter's full (unsharded) shape
    start: int
    stop: int
    trainable: bool = True  # the (flat) parameter holding the piece requires grad


def flat_pieces(model: torch.nn.Module) -> dict[int, FlatPiece]:
    """id(original parameter) -> FlatPiece for every parameter managed by an FSDP1 unit in `model`
    (empty for a model without FSDP1). Raises CFPError for FSDP1 layouts CFP cannot correct."""
    pieces = {}
    for module in model.modules():
        handle = getattr(module, "_handle", None) if isinstance(module, FullyShardedDataParallel) else None
        if handle is None:
            continue
        flat = handle.flat_param
        if not handle.uses_sharded_strategy:  # NO_SHARD: full parameters in their shapes, bound like DDP's
            if not handle._use_orig_params:
                raise CFPError(
                    "CFPCallback supports FSDP1 NO_SHARD only with use_orig_params=True (fsdp_use_orig_params: "
                    "true in the accelerate config). Set it, or use DDP."
                )
            continue
        if module.process_group.size() != process_rank_and_count()[1]:
            raise CFPError(
                f"CFPCallback supports FSDP1 sharded over all processes, not hybrid sharding "
                f"({module.sharding_strategy}): use FULL_SHARD / SHARD_GRAD_OP, FSDP2, or DDP."
            )
        if not handle._use_orig_params:  # flat parameters: bound through views (`flat_parameters`)
            continue
        for param, info, shape, fqn in zip(
            flat._params, flat._shard_param_infos, flat._shapes, flat._fqns, strict=True
        ):
            start, stop = (info.intra_param_start_idx, info.intra_param_end_idx + 1) if info.in_shard else (0, 0)
            if param.numel() != stop - start:
                raise CFPError(
                    f"FSDP1 parameter {fqn!r} holds {param.numel()} elements, not its {stop - start}-element "
                    f"sharded piece: CFP binds between steps, outside forward/backward and summon_full_params."
                )
            pieces[id(param)] = FlatPiece(torch.Size(shape), start, stop)
    return pieces


def flat_parameters(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, FlatPiece]]:
    """Canonical original name -> (1-D view of its piece in this process's local FlatParameter shard,
    FlatPiece) for every parameter of an FSDP1 unit with use_orig_params=False (sharded over all
    processes; `flat_pieces` refuses the other layouts, binding calls it first). The view shares the
    shard's memory: writing it updates the FlatParameter in place. The views are kept on the handle,
    so that binding several anchors yields the same tensor objects (one theta0 per piece). Empty for
    other models."""
    views = {}
    for prefix, module in model.named_modules():
        handle = getattr(module, "_handle", None) if isinstance(module, FullyShardedDataParallel) else None
        if handle is None or handle._use_orig_params or not handle.uses_sharded_strategy:
            continue
        flat = handle.flat_param
        local = flat.detach()
        if local.numel() != flat._sharded_size.numel():
            raise CFPError(
                "FSDP1 flat parameter is unsharded: CFP binds between steps, outside "
                "forward/backward and summon_full_params."
            )
        cached = getattr(handle, "_cfp_flat_views", None)  # the same view objects for every anchor bound
        if cached is not None and cached[0] == local.data_ptr():
            views.update(cached[1])
            continue
        unit_views = {}
        unit = f"{prefix}._fsdp_wrapped_module." if prefix else "_fsdp_wrapped_module."
        for info, shape, fqn in zip(flat._shard_param_infos, flat._shapes, flat._fqns, strict=True):
            if info.in_shard:
                view = local[info.offset_in_shard : info.offset_in_shard + info.numel_in_shard]
                piece = FlatPiece(
                    torch.Size(shape), info.intra_param_start_idx, info.intra_param_end_idx + 1, flat.requires_grad
                )
            else:
                view, piece = local[:0], FlatPiece(torch.Size(shape), 0, 0, flat.requires_grad)
            unit_views[canonical_name(unit + fqn)] = (view, piece)
        handle._cfp_flat_views = (local.data_ptr(), unit_views)
        views.update(unit_views)
    return views
