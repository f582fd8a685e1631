"""FSDP1 (`FullyShardedDataParallel` with `use_orig_params=True`): which piece of each parameter a process holds.

FSDP1 flattens the parameters of each wrapped unit into one FlatParameter and gives every process
a contiguous slice of it. With `use_orig_params=True` each original parameter stays a Parameter,
but between forward passes its data is a 1-D view of this process's part of the flattened
parameter: elements [start, stop) of `param_full.reshape(-1)`, possibly empty. A process binds
the same piece of F, corrects that view in place (it writes through into the FlatParameter) and
adds its sums of squares to the other processes' ones, like FSDP2's shards.

`use_orig_params=False` (only FlatParameters are visible) and hybrid sharding are refused.
"""

from dataclasses import dataclass

import torch

from .errors import CFPError


@dataclass(frozen=True)
class FlatPiece:
    """This process's part of one original parameter under FSDP1: flat elements [start, stop)."""

    shape: torch.Size  # the parameter's full (unsharded) shape
    start: int
    stop: int

    def fisher(self, fisher: torch.Tensor) -> torch.Tensor:
        """F restricted to the piece, copied so that only the piece's memory is kept."""
        return fisher.reshape(-1)[self.start:self.stop].clone()


def flat_pieces(model: torch.nn.Module) -> dict[int, FlatPiece]:
    """id(original parameter) -> FlatPiece for every parameter managed by an FSDP1 unit in `model`
    (empty for a model without FSDP1). Raises CFPError for FSDP1 layouts CFP cannot correct."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    from .distributed import process_rank_and_count

    pieces = {}
    for module in model.modules():
        handle = getattr(module, "_handle", None) if isinstance(module, FullyShardedDataParallel) else None
        if handle is None:
            continue
        flat = handle.flat_param
        if not handle._use_orig_params or flat._params is None:
            raise CFPError(
                "CFPCallback supports FSDP1 (FullyShardedDataParallel) only with use_orig_params=True "
                "(fsdp_use_orig_params: true in the accelerate config), not flat parameters. Set it, or use "
                "FSDP2 (fsdp_version: 2) or DDP.")
        if not handle.uses_sharded_strategy:  # NO_SHARD: full parameters in their shapes, bound like DDP's
            continue
        if module.process_group.size() != process_rank_and_count()[1]:
            raise CFPError(
                f"CFPCallback supports FSDP1 sharded over all processes, not hybrid sharding "
                f"({module.sharding_strategy}): use FULL_SHARD / SHARD_GRAD_OP, FSDP2, or DDP.")
        for param, info, shape, fqn in zip(flat._params, flat._shard_param_infos, flat._shapes, flat._fqns):
            start, stop = (info.intra_param_start_idx, info.intra_param_end_idx + 1) if info.in_shard else (0, 0)
            if param.numel() != stop - start:
                raise CFPError(
                    f"FSDP1 parameter {fqn!r} holds {param.numel()} elements, not its {stop - start}-element "
                    f"sharded piece: CFP binds between steps, outside forward/backward and summon_full_params.")
            pieces[id(param)] = FlatPiece(torch.Size(shape), start, stop)
    return pieces
