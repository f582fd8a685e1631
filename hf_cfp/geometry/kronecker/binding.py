"""The Kronecker geometry's binding: a K-FAC anchor's factored weights bound to a live model: match names, check the
factors' shapes against the layer, and keep the eigenbases this process needs on the weight's device.

A weight W (out x in) needs Q_A (in x r_A) whole and the rows of Q_G (out x r_G) for the rows of W it holds: all
of them under DDP, its rows under FSDP2 (a DTensor sharded on dim 0; from a lazy anchor only those rows are read).
GPT-2's Conv1D stores W^T (in x out): the factors are those of W, and the bound tensor is marked `transposed`.
Layouts that hold arbitrary flat pieces (FSDP1, DeepSpeed ZeRO-3) cannot be rotated piecewise and are refused.
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import partial

import torch
from torch.distributed.tensor import DTensor
from transformers.pytorch_utils import Conv1D

from ...errors import AnchorMismatchError, CFPArgumentError
from ...parallel.shards import dtensor_local_block
from ...quantized import logical_shape
from ..base import NamedFisher
from ..binding import HeldRange, matched_parameters
from .artifact import LazyBases, weight_shape
from .basis import KroneckerBasis


@dataclass
class BoundKronecker:
    """One K-FAC weight of an anchor matched to the trainable parameter it describes."""

    name: str
    param: torch.Tensor
    basis: KroneckerBasis  # float32 on the parameter's device; Q_G's rows for the rows held here
    sharded: bool  # rows split across processes (FSDP2): rotations are completed by an all-reduce
    held: HeldRange
    transposed: bool  # the parameter stores W^T (Conv1D)


def bind_kronecker(
    anchor: NamedFisher, model: torch.nn.Module, names: Mapping[str, torch.Tensor] | None = None
) -> list[BoundKronecker]:
    """Every K-FAC weight of `anchor` matched by canonical name to a trainable parameter of `model` (`names`: the
    base-model names of a PeftModel, as for `geometry.binding.matched_parameters`). Frozen ones are skipped; a
    LoRA-adapted base weight is bound by `protection.peft_adapters`, not here.

    Raises:
        AnchorMismatchError: a weight the model does not have, or factors whose sizes do not fit its shape.
        CFPArgumentError: a weight held as a flat piece (FSDP1, DeepSpeed ZeRO-3), or sharded along its columns.
    """
    conv1d = {id(m.weight) for m in model.modules() if isinstance(m, Conv1D)}
    matched = matched_parameters(anchor, list(anchor.kfac), model, names, partial(_check_factors, conv1d=conv1d))
    return [
        _bound(anchor, name, param, id(param) in conv1d, math.prod(weight_shape(anchor.kfac, name)))
        for name, param, _ in matched
    ]


def _check_factors(anchor: NamedFisher, name: str, param: torch.Tensor, piece, conv1d: set[int]) -> None:
    """A weight held as a flat piece cannot be rotated; factors must fit the weight (W^T for a Conv1D)."""
    if piece is not None:
        raise CFPArgumentError(
            f"Anchor {anchor.name!r} is Kronecker-factored, and {name!r} is held as a flat piece (FSDP1 or "
            "DeepSpeed ZeRO-3): a rotation needs whole rows. Train with DDP or FSDP2 (fully_shard), or use a "
            "diagonal anchor."
        )
    out_dim, in_dim = weight_shape(anchor.kfac, name)
    shape = tuple(logical_shape(param))
    if shape != ((in_dim, out_dim) if id(param) in conv1d else (out_dim, in_dim)):
        raise AnchorMismatchError(
            f"Anchor {anchor.name!r}: the Kronecker factors of {name!r} are for a {out_dim} x {in_dim} weight "
            f"(G {out_dim} x {out_dim}, A {in_dim} x {in_dim}), but the model's is {shape}. Was the anchor "
            "computed for another model?"
        )


def _bound(anchor: NamedFisher, name: str, param: torch.Tensor, transposed: bool, numel: int) -> BoundKronecker:
    """The basis this process needs for `param` (all rows, or a DTensor's local rows), on its device."""
    rows, sharded, held = slice(None), False, HeldRange(0, numel, numel)
    if isinstance(param, DTensor):
        offsets, lengths, sharded = dtensor_local_block(name, param)
        if sharded and (transposed or offsets[1:] != [0] or lengths[1] != param.shape[1]):
            raise CFPArgumentError(
                f"{name!r} is sharded along its columns (placements {tuple(param.placements)}): a K-FAC anchor "
                "needs whole rows of each weight (FSDP2 shards dim 0). Shard on dim 0, or use a diagonal anchor."
            )
        rows = slice(offsets[0], offsets[0] + lengths[0])
        columns = param.shape[1]
        held = HeldRange(rows.start * columns, rows.stop * columns, numel)
    bases = anchor.kfac
    basis = bases.rows(name, rows) if isinstance(bases, LazyBases) and sharded else bases[name]
    if sharded and not isinstance(bases, LazyBases):
        basis = replace(basis, g_vectors=basis.g_vectors[rows])
    return BoundKronecker(name, param, basis.placed(param.device), sharded, held, transposed)
