"""DeepSpeed ZeRO: the K-FAC correction of the optimizer's fp32 master copy.

The optimizer steps its own fp32 master copy and copies it back into the model parameters after each step, so a
correction of the model parameters alone would be overwritten (`parallel.deepspeed`). Of each K-FAC weight, this
process's master partition holds a flat piece: under ZeRO-1/2 the fragment at `param._hp_mapping` (elements
[start, start + numel) of the flattened weight, none on some processes), under ZeRO-3 the partition at the same
offsets as the parameter's own (`optimizer.get_local_fp32_param`). Each is corrected as FSDP1's pieces are
(`flat.FlatPieces`, `pieces`: one all-reduce per weight, every process taking part), from its own fp32 values and
theta0 sliced to it, with U_G's rows for the rows it touches; the model parameters are corrected by the K-FAC state
beside it (whole weights under ZeRO-1/2, partitions under ZeRO-3). Under ZeRO-3 with the master copy offloaded,
`get_local_fp32_param` copies the partition to the accelerator: the protected partitions are fetched before the
correction and set back after it.
"""

from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial

import torch

from ...parallel.deepspeed import is_zero3, master_fragment_range, zero3_master_partition, zero_optimizer
from ..binding import HeldRange
from .basis import KroneckerBasis
from .flat import FlatPieces
from .pieces import PieceRows
from .state import KroneckerTensors


class _Fragment:
    """One K-FAC weight's part of this process's fp32 master partition, as `flat.FlatPieces` reads it: `local()` is
    its first `numel` elements as last fetched."""

    def __init__(
        self,
        theta0: torch.Tensor,
        held: HeldRange,
        kfac: dict[str, KroneckerBasis],
        read: Callable[[], torch.Tensor],
        write: Callable[[torch.Tensor], None] | None,
    ):
        self.theta0, self.held, self.kfac = theta0, held, kfac
        self.read, self.write = read, write
        self.partition = read()

    def fetch(self) -> None:
        self.partition = self.read()

    def local(self) -> torch.Tensor:
        return self.partition.view(-1)[: self.theta0.numel()]

    def store(self) -> None:
        if self.write is not None:
            self.write(self.partition)


def _zero12_fragment(t, anchor: str) -> _Fragment:
    """The ZeRO-1/2 master fragment of the whole weight `t` (`parallel.deepspeed.master_fragment_range`)."""
    start, numel = master_fragment_range(t.param)
    mapping = t.param._hp_mapping if numel else None
    read = mapping.get_hp_fragment if mapping is not None else lambda: t.param.new_empty(0, dtype=torch.float32)
    device = read().device
    basis = t.kfac[anchor]
    rows = PieceRows(start, start + numel, basis.a_vectors.shape[-2]).rows
    basis = replace(basis, g_vectors=basis.g_vectors[rows]).placed(device, basis.g_vectors.dtype)
    theta0 = t.theta0.reshape(-1)[start : start + numel].to(device)
    return _Fragment(theta0, HeldRange(start, start + numel, t.param.numel()), {anchor: basis}, read, None)


def _zero3_fragment(zero, t, anchor: str) -> _Fragment:
    """The ZeRO-3 master partition of the partitioned weight `t` (the same offsets as `t`'s)."""
    read, write = zero3_master_partition(zero, t.param)
    device = read().device
    basis = t.kfac[anchor]
    placed = basis.placed(device, basis.g_vectors.dtype)
    return _Fragment(t.theta0.to(device), t.held, {anchor: placed}, read, write)


class KroneckerMaster:
    """The protecting K-FAC anchors' weights in this process's fp32 master partition, one `flat.FlatPieces` per
    protected group, corrected with that group's lam."""

    def __init__(self, zero, kronecker: KroneckerTensors):
        fragment = partial(_zero3_fragment, zero) if is_zero3(zero) else _zero12_fragment
        self.groups: list[tuple[int, FlatPieces]] = []
        self.fragments: list[_Fragment] = []
        for k, group in kronecker.protected():
            tensors = [t for batch in group.batches for t in batch.tensors]
            fragments = [fragment(t, group.anchor) for t in tensors]
            self.groups.append((k, FlatPieces(group.anchor, fragments)))
            self.fragments += fragments

    @torch.no_grad()
    def correct(self, lams: Sequence[float]) -> None:
        """Each protected group's master pieces pulled with its anchor's lam (the same on every process)."""
        for fragment in self.fragments:
            fragment.fetch()
        for k, group in self.groups:
            if lams[k]:
                group.pull_(lams[k])
        for fragment in self.fragments:
            fragment.store()


def kronecker_master(optimizer, kronecker: KroneckerTensors) -> KroneckerMaster | None:
    """The K-FAC correction of the fp32 master copy under DeepSpeed ZeRO, or None (no ZeRO optimizer, or no weight a
    protecting K-FAC anchor factors alone)."""
    zero = zero_optimizer(optimizer)
    if zero is None or not kronecker.protected():
        return None
    return KroneckerMaster(zero, kronecker)
