"""Process-group helpers: who does which share of the work, and summing results across processes.

Works under `accelerate launch` / `torchrun` (any initialized torch.distributed group) and
degrades to a single process otherwise.
"""

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def process_rank_and_count() -> tuple[int, int]:
    """(rank, number of processes) of the initialized default group, or (0, 1)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def log_on_main_process(log: Callable[..., None], message: str, *args: Any) -> None:
    """Call `log(message, *args)` on the main process (rank 0, or the only process) and nowhere else.

    For messages every process would emit alike (the same model, anchor and arguments everywhere), so that a
    run on n processes prints them once, not n times. `log` is a logger method: `logger.warning_once` (once
    per process and message, transformers' cache), `logger.warning` or `logger.info`.

    Args:
        log (`Callable`):
            A bound logger method, e.g. `logger.warning_once` of `transformers.utils.logging.get_logger(__name__)`.
        message (`str`):
            The %-style format string.
        *args:
            Its arguments (hashable, for `warning_once`'s cache).
    """
    if process_rank_and_count()[0] == 0:
        log(message, *args)


@torch.no_grad()
def all_reduce_sum_(tensors: list[torch.Tensor], bucket_elements: int = 2**24) -> None:
    """In place: every tensor becomes the sum of its copies over all processes.

    Tensors are flattened into buckets of at most `bucket_elements` elements (plus one
    oversize tensor alone) so that there are few collectives and bounded extra memory.
    """
    _, count = process_rank_and_count()
    if count == 1:
        return
    bucket: list[torch.Tensor] = []
    size = 0
    for tensor in [*tensors, None]:
        if tensor is not None and (size + tensor.numel() <= bucket_elements or not bucket):
            bucket.append(tensor)
            size += tensor.numel()
            continue
        if bucket:
            flat = torch.cat([t.reshape(-1) for t in bucket])
            dist.all_reduce(flat)
            for t, part in zip(bucket, flat.split([t.numel() for t in bucket]), strict=True):
                t.copy_(part.view_as(t))
        bucket, size = ([tensor], tensor.numel()) if tensor is not None else ([], 0)
