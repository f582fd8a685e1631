"""Bounded work: every full-size computation of CFP visits a tensor's flat elements in spans of at most
`CHUNK_ELEMENTS`, so its temporaries are a few chunks in size, never the size of the model."""

from collections.abc import Iterator

import torch

CHUNK_ELEMENTS = 1 << 22  # 4 Mi elements: 16 MB per float32 temporary


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
