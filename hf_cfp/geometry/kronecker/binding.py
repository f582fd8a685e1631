"""The Kronecker geometry's binding: a K-FAC anchor's factored weights bound to a live model: match names, check the
factors' shapes against the layer, and keep the eigenbases this process needs on the weight's device.

A weight W (out x in) needs Q_A (in x r_A) whole and the rows of Q_G (out x r_G) for the rows of W it holds: all
of them under DDP, its rows under FSDP2 (a DTensor sharded on dim 0), the rows its flat piece touches under FSDP1
and DeepSpeed ZeRO-3 (elements [start, stop) of the flattened weight, `pieces.PieceRows`); from a lazy anchor only
those rows are read. GPT-2's Conv1D stores W^T (in x out): the factors are those of W, and the bound tensor is
marked `transposed`; a flat piece of a Conv1D weight (its rows are W's columns) is refused.
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import partial

import torch
from torch.distributed.tensor import DTensor
from transformers.pytorch_utils import Conv1D

from ...errors import AnchorMismatchError, CFPArgumentError
from ...parallel.fsdp1 import FlatPiece
from ...parallel.shards import dtensor_local_block, local_tensor
from ...quantized import logical_shape
from ..base import NamedFisher
from ..binding import HeldRange, matched_parameters
from .artifact import LazyBases, weight_shape
from .basis import KroneckerBasis
from .pieces import PieceRows


@dataclass
class BoundKronecker:
    """One K-FAC weight of an anchor matched to the trainable parameter it describes."""

    name: str
    param: torch.Tensor
    basis: KroneckerBasis  # float32 on the parameter's device; Q_G's rows for the rows held here
    sharded: bool  # split across processes (FSDP2 rows, flat pieces): rotations are completed by an all-reduce
    held: HeldRange  # a flat piece's elements (FSDP1, ZeRO-3), or the rows held
    transposed: bool  # the parameter stores W^T (Conv1D)


def bind_kronecker(
    anchor: NamedFisher, model: torch.nn.Module, names: Mapping[str, torch.Tensor] | None = None
) -> list[BoundKronecker]:
    """Every K-FAC weight of `anchor` matched by canonical name to a trainable parameter of `model` (`names`: the
    base-model names of a PeftModel, as for `geometry.binding.matched_parameters`). Frozen ones are skipped; a
    LoRA-adapted base weight is bound by `protection.peft_adapters`, not here.

    Raises:
        AnchorMismatchError: a weight the model does not have, or factors whose sizes do not fit its shape.
        CFPArgumentError: a Conv1D weight held as a flat piece, or a weight sharded along its columns.
    """
    conv1d = {id(m.weight) for m in model.modules() if isinstance(m, Conv1D)}
    matched = matched_parameters(anchor, list(anchor.kfac), model, names, partial(_check_factors, conv1d=conv1d))
    return [
        _bound_piece(anchor, name, param, piece)
        if piece is not None
        else _bound(anchor, name, param, id(param) in conv1d, math.prod(weight_shape(anchor.kfac, name)))
        for name, param, piece in matched
    ]


def _check_factors(anchor: NamedFisher, name: str, param: torch.Tensor, piece, conv1d: set[int]) -> None:
    """Factors must fit the weight (W^T for a Conv1D, which cannot be held as a flat piece)."""
    if piece is not None and id(param) in conv1d:
        raise CFPArgumentError(
            f"Anchor {anchor.name!r} is Kronecker-factored, and the Conv1D weight {name!r} (it stores W^T) is held as "
            "a flat piece (FSDP1 or DeepSpeed ZeRO): its pieces cut W's columns, which the correction does not "
            "support. Train with DDP or FSDP2 (fully_shard), or use a diagonal anchor."
        )
    out_dim, in_dim = weight_shape(anchor.kfac, name)
    shape = tuple(piece.shape if piece is not None else logical_shape(param))
    if shape != ((in_dim, out_dim) if id(param) in conv1d else (out_dim, in_dim)):
        raise AnchorMismatchError(
            f"Anchor {anchor.name!r}: the Kronecker factors of {name!r} are for a {out_dim} x {in_dim} weight "
            f"(G {out_dim} x {out_dim}, A {in_dim} x {in_dim}), but the model's is {shape}. Was the anchor "
            "computed for another model?"
        )


def _bound_piece(anchor: NamedFisher, name: str, param: torch.Tensor, piece: FlatPiece) -> BoundKronecker:
    """The basis of a weight held as a flat piece: U_G's rows for the rows the piece touches, on its device."""
    out_dim, in_dim = weight_shape(anchor.kfac, name)
    basis = _with_rows(anchor, name, PieceRows(piece.start, piece.stop, in_dim).rows)
    held = HeldRange(piece.start, piece.stop, out_dim * in_dim)
    return BoundKronecker(name, param, basis.placed(local_tensor(param).device), True, held, False)


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
    basis = _with_rows(anchor, name, rows) if sharded else anchor.kfac[name]
    return BoundKronecker(name, param, basis.placed(param.device), sharded, held, transposed)


def _with_rows(anchor: NamedFisher, name: str, rows: slice) -> KroneckerBasis:
    """The basis of `name` with U_G's `rows` only (from a lazy anchor, only those rows are read)."""
    bases = anchor.kfac
    if isinstance(bases, LazyBases):
        return bases.rows(name, rows)
    return replace(bases[name], g_vectors=bases[name].g_vectors[rows])
