"""The diagonal geometry's part of the anchor artifact: the values F may hold (`check_fisher_values`), and F left
in its safetensors files (`FisherAnchor.from_pretrained(..., lazy=True)`), read a tensor, or a part of one, at a
time. Its tensors are stored under their parameter names (the Kronecker part's keys carry a `kfac/` prefix).

A process that keeps only pieces of the parameters (FSDP1, FSDP2, ZeRO-3) reads only the pieces of F it binds
(`read_flat`, `read_block`: safetensors' `get_slice`), and whatever needs the whole of F (statistics, the free
drift threshold) visits it one tensor at a time, so the full anchor is never in a process's memory.
`fisher_shape`, `read_flat` and `read_block` also take an ordinary name -> tensor mapping (an anchor in memory),
so callers need not know which one they hold.
"""

import math
from collections.abc import Iterator, Mapping, Sequence

import torch

from ...errors import AnchorValidationError
from ...names import canonical_name
from ..base import Stored


def check_fisher_values(name: str, tensor: torch.Tensor, anchor_name: str) -> None:
    """Raise AnchorValidationError naming the anchor and parameter when `tensor` holds NaN, Inf or F_i < 0: F is
    finite and >= 0 (a mean of squared scores)."""
    bad = ~torch.isfinite(tensor)
    if bad.any():
        raise AnchorValidationError(
            f"Anchor {anchor_name!r}: parameter {name!r} has {int(bad.sum())} NaN/Inf Fisher values. "
            "The anchor is corrupt or its estimation overflowed; re-estimate it (in float32)."
        )
    negative = tensor < 0
    if negative.any():
        raise AnchorValidationError(
            f"Anchor {anchor_name!r}: parameter {name!r} has {int(negative.sum())} negative Fisher values "
            f"(min {float(tensor.min()):.3g}). A diagonal Fisher is a mean of squares; re-estimate the anchor."
        )


class LazyFisher(Mapping[str, torch.Tensor]):
    """name -> F as a float32 CPU tensor, read from the files at each access (nothing is kept), its values
    checked as they are read (finite, >= 0: `check_fisher_values`). Names, shapes and stored dtypes come
    from the headers, read once. `bytes_read` counts the stored bytes this object has read so far.

    Args:
        stored: stored name -> where it lies (`anchor.storage.stored_tensors`); names are made canonical.
        anchor_name: the anchor's name, for error messages.
    """

    def __init__(self, stored: Mapping[str, Stored], anchor_name: str):
        self._stored = {canonical_name(name): (name, entry) for name, entry in stored.items()}
        self.anchor_name = anchor_name
        self.bytes_read = 0

    def __getitem__(self, name: str) -> torch.Tensor:
        stored_name, entry = self._stored[name]
        return self._checked(name, entry.read(stored_name), entry.shape.numel())

    def __iter__(self) -> Iterator[str]:
        return iter(self._stored)

    def __len__(self) -> int:
        return len(self._stored)

    def __contains__(self, name: object) -> bool:
        return name in self._stored

    def shape(self, name: str) -> torch.Size:
        """The full shape of F[name], from the header."""
        return self._stored[name][1].shape

    def read_flat(self, name: str, start: int, stop: int) -> torch.Tensor:
        """F[name].reshape(-1)[start:stop], reading only the rows (slices of the first dimension) that hold it:
        with r = prod(shape[1:]), rows floor(start / r) .. ceil(stop / r), at most 2 rows more than asked."""
        stored_name, entry = self._stored[name]
        if start >= stop:
            return torch.empty(0, dtype=torch.float32)
        row = math.prod(entry.shape[1:])
        first, last = (start // row, -(-stop // row)) if entry.shape else (0, 1)
        rows = entry.read(stored_name, (slice(first, last),) if entry.shape else None)
        part = rows.reshape(-1)[start - first * row : stop - first * row].clone()
        return self._checked(name, part, (last - first) * row)

    def read_block(self, name: str, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
        """F[name][o_0 : o_0 + n_0, o_1 : o_1 + n_1, ...] for offsets o and lengths n, reading only that block."""
        stored_name, entry = self._stored[name]
        if math.prod(lengths) == 0:
            return torch.empty(tuple(lengths))
        index = tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=True)) or None  # 0-d: read whole
        return self._checked(name, entry.read(stored_name, index), math.prod(lengths))

    def _checked(self, name: str, tensor: torch.Tensor, elements_read: int) -> torch.Tensor:
        self.bytes_read += elements_read * self._stored[name][1].dtype.itemsize
        check_fisher_values(name, tensor, self.anchor_name)
        return tensor


class TensorsOf(Sequence[torch.Tensor]):
    """fisher[names[i]], looked up at each access: over a LazyFisher a pass reads one tensor at a time and
    never holds them all (what `ops.order_statistics` needs to stream the whole of F)."""

    def __init__(self, fisher: Mapping[str, torch.Tensor], names: Sequence[str]):
        self.fisher, self.names = fisher, list(names)

    def __getitem__(self, index):  # an integer index
        return self.fisher[self.names[index]]

    def __len__(self) -> int:
        return len(self.names)


def fisher_shape(fisher: Mapping[str, torch.Tensor], name: str) -> torch.Size:
    """The shape of fisher[name], without reading a LazyFisher's values."""
    return fisher.shape(name) if isinstance(fisher, LazyFisher) else fisher[name].shape


def read_flat(fisher: Mapping[str, torch.Tensor], name: str, start: int, stop: int) -> torch.Tensor:
    """A copy of fisher[name].reshape(-1)[start:stop] (from a LazyFisher: only the rows holding it are read)."""
    if isinstance(fisher, LazyFisher):
        return fisher.read_flat(name, start, stop)
    return fisher[name].reshape(-1)[start:stop].clone()


def read_block(
    fisher: Mapping[str, torch.Tensor], name: str, offsets: Sequence[int], lengths: Sequence[int]
) -> torch.Tensor:
    """A copy of fisher[name][o_0 : o_0 + n_0, ...] (from a LazyFisher: only that block is read)."""
    if isinstance(fisher, LazyFisher):
        return fisher.read_block(name, offsets, lengths)
    return fisher[name][tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))].clone()
