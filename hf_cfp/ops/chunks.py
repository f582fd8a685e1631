"""Bounded work: every full-size computation of CFP visits the tensors' flat elements in spans of at most
`chunk_elements(device)`, in float32 buffers reused from call to call (`workspace`), so its temporaries are a
few chunks in size, never the size of the model, and stay in the CPU's cache. `packs` lays many small
tensors side by side in one chunk, so the work costs a few operations per chunk rather than per tensor (on a
GPU, kernel launches would otherwise dominate: a 135M model has ~270 tensors)."""

from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, TypeVar

import torch

CHUNK_ELEMENTS = 1 << 18  # on a CPU, 256 Ki elements: 1 MB per float32 buffer (fits a core's L2 cache)
ACCELERATOR_CHUNK_ELEMENTS = 1 << 24  # on a GPU, 16 Mi elements (64 MB): few kernel launches per tensor


def chunk_elements(device: torch.device) -> int:
    """The span length for work on `device`: cache-sized on a CPU, launch-amortizing on an accelerator."""
    return CHUNK_ELEMENTS if device.type == "cpu" else ACCELERATOR_CHUNK_ELEMENTS


_WORKSPACES: dict[tuple[torch.device, int], list[torch.Tensor]] = {}


def workspace(device: torch.device, count: int, size: int = CHUNK_ELEMENTS) -> list[torch.Tensor]:
    """`count` float32 buffers of `size` elements on `device`, allocated once per (device, size) and reused:
    slice them to a span's length. Callers must not hold them across calls to other users of the workspace."""
    buffers = _WORKSPACES.setdefault((torch.device(device), size), [])
    while len(buffers) < count:
        buffers.append(torch.empty(size, dtype=torch.float32, device=device))
    return buffers[:count]


def spans(numel: int, size: int = CHUNK_ELEMENTS) -> Iterator[slice]:
    """[0, size), [size, 2 size), ... covering [0, numel) (nothing for numel = 0)."""
    if size < 1:
        raise ValueError(f"spans: size must be >= 1, got {size}.")
    for start in range(0, numel, size):
        yield slice(start, min(start + size, numel))


def flat(tensor: torch.Tensor) -> torch.Tensor:
    """The 1-D view of `tensor`'s elements (never a copy: writes through it reach the tensor)."""
    if not tensor.is_contiguous():
        raise ValueError(f"Expected a contiguous tensor, got strides {tensor.stride()} for {tuple(tensor.shape)}.")
    return tensor.view(-1)


class Piece(NamedTuple):
    """Elements `span` of tensor `tensor`'s flat view, laid out at `slot` of its pack's buffers."""

    tensor: int
    span: slice
    slot: slice


Key = TypeVar("Key", bound=Hashable)


@dataclass(frozen=True)
class Pack(Generic[Key]):
    """Pieces of tensors that share a device and a `key`, laid out one after another in buffers of `length`
    elements (`workspace(device, count, length)`); they fill `[0, size)` of them."""

    device: torch.device
    key: Key
    length: int
    pieces: list[Piece]

    @property
    def size(self) -> int:
        return self.pieces[-1].slot.stop


def packs(tensors: Sequence[torch.Tensor], keys: Sequence[Key], length: int | None = None) -> Iterator[Pack[Key]]:
    """The tensors' elements in packs of at most `length` (default `chunk_elements(device)`) elements, each of
    tensors with one (device, key): a tensor longer than `length` is cut into spans, shorter ones share a pack.

    One pack is then a few whole-buffer operations (`gather`, arithmetic, `scatter`) whatever the number of
    tensors in it, so work on many small tensors costs launches per pack, not per tensor."""
    groups: dict[tuple[torch.device, Key], list[int]] = {}
    for i, (tensor, key) in enumerate(zip(tensors, keys, strict=True)):
        groups.setdefault((tensor.device, key), []).append(i)
    for (device, key), members in groups.items():
        size = length or chunk_elements(device)
        pieces: list[Piece] = []
        for i in members:
            for span in spans(tensors[i].numel(), size):
                used = pieces[-1].slot.stop if pieces else 0
                if used + span.stop - span.start > size:
                    yield Pack(device, key, size, pieces)
                    pieces, used = [], 0
                pieces.append(Piece(i, span, slice(used, used + span.stop - span.start)))
        if pieces:
            yield Pack(device, key, size, pieces)


def gather(buffer: torch.Tensor, pack: Pack[Any], flats: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """buffer[piece.slot] <- flats[piece.tensor][piece.span] for every piece (widened to the buffer's float32;
    `flats` are 1-D, on any device), as one multi-tensor copy where all are on the buffer's device; returns
    buffer[:pack.size]."""
    sources = [_flat_source(flats, piece) for piece in pack.pieces]
    targets = [buffer[piece.slot] for piece in pack.pieces]
    if all(source.device == buffer.device for source in sources):
        torch._foreach_copy_(targets, sources)
    else:  # offloaded to the CPU (pinned): asynchronous host-to-device copies
        for target, source in zip(targets, sources, strict=True):
            target.copy_(source, non_blocking=True)
    return buffer[: pack.size]


def scatter(flats: Sequence[torch.Tensor], pack: Pack[Any], values: torch.Tensor) -> None:
    """flats[piece.tensor][piece.span] <- values[piece.slot] for every piece (rounded once to each tensor's
    dtype), as one multi-tensor copy: the inverse of `gather`."""
    torch._foreach_copy_([flats[p.tensor][p.span] for p in pack.pieces], [values[p.slot] for p in pack.pieces])


def _flat_source(flats: Sequence[torch.Tensor | None], piece: Piece) -> torch.Tensor:
    source = flats[piece.tensor]
    if source is None:
        raise ValueError(f"gather: tensor {piece.tensor} has no values to gather (None) in a pack that needs them.")
    return source[piece.span]
