"""Bounded work: every full-size computation of CFP visits a tensor's flat elements in spans of at most
`CHUNK_ELEMENTS`, in float32 buffers reused from call to call (`workspace`), so its temporaries are a few
chunks in size, never the size of the model, and stay in the CPU's cache."""

from collections.abc import Iterator

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
