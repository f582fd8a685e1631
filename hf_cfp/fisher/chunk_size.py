"""How much memory the batched engine may give one chunk of per-sequence gradients.

The engine forms a parameter's per-sequence gradients G_b for a chunk of sequences at a time: the
chunk's float32 sum over uses, plus the one use's term being added to it, 2 x 4 bytes per element.
By default a chunk may take 1/16 of the memory available on the device when the backward starts:

    max_chunk_elements = min(2**26, available_bytes // 128)          (2 x 4 bytes x 16 = 128)

available_bytes being MemAvailable on the CPU (psutil) and, on CUDA, the free device memory plus
the blocks PyTorch's allocator holds unused. The cap, 2^26 elements (256 MB), is where more
sequences per chunk stop paying: a chunk already spans the whole batch for every tensor of a
135M model but its embedding. A chunk holds at least one sequence whatever the budget.
"""

import psutil
import torch

__all__ = ["CHUNK_CAP", "available_bytes", "default_chunk_elements"]

CHUNK_CAP = 2**26
_BYTES_PER_ELEMENT = 8  # the chunk's float32 sum and one use's float32 term being added to it
_SHARE = 16  # a chunk takes at most 1/_SHARE of the available memory


def available_bytes(device: torch.device) -> int:
    """Bytes that can still be allocated on `device` without swapping or an out-of-memory error."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return psutil.virtual_memory().available


def default_chunk_elements(device: torch.device) -> int:
    """min(CHUNK_CAP, available_bytes(device) // 128): a chunk's two float32 buffers within 1/16 of it."""
    return min(CHUNK_CAP, available_bytes(device) // (_BYTES_PER_ELEMENT * _SHARE))
