"""Process-group helpers: who does which share of the work, and summing results across processes.

Works under `accelerate launch` / `torchrun` (any initialized torch.distributed group) and
degrades to a single process otherwise.

**Device safety.** A collective reduces tensors of the devices its backend handles (NCCL: CUDA tensors only), and
`torch.cat` of a bucket needs one device. `all_reduce_sum_` therefore takes the tensors of one device and refuses a
list that mixes devices on any number of processes (a one-GPU run, or a CPU test with a `meta` tensor, catches what
NCCL would reject on many GPUs), and under a process group refuses a device its backend cannot reduce, before any
collective runs. Dtypes are bucketed apart (no silent promotion). Sums kept beside parameters are reduced on their
device; a counter that belongs to no parameter is kept on `collective_device()`, in a call of its own.

**Why not accelerate's helpers** (checked against accelerate 1.15; they do not do the same thing here):

- `accelerate.PartialState` is a singleton that its first construction initializes: without an `Accelerator` it
  may call `torch.distributed.init_process_group` and `torch.cuda.set_device`, and on CPUs write RANK, WORLD_SIZE,
  LOCAL_RANK and MASTER_PORT into `os.environ` and call `torch.set_num_threads`. hf-cfp must not have such side
  effects on a user's process.
- It does not see a process group it did not start: under `torchrun` with a gloo group on CPUs (a user's own
  `init_process_group`, this suite's multi-process tests) it reports `DistributedType.NO` and one process, and
  `accelerate.utils.reduce(tensor, "sum")` then returns each process's tensor unreduced: a silently wrong anchor.
  torch.distributed is the state both accelerate and torchrun set up, so rank and world size are read there.
- `accelerate.utils.reduce` clones each tensor and reduces it with its own collective; `all_reduce_sum_` sums in
  place, many tensors per collective.
- `accelerate.logging.get_logger(...)`'s `main_process_only` raises unless a `PartialState` exists, prefixes
  "[RANK n]" and wraps the standard logger; `log_on_main_process` takes transformers' loggers (`warning_once`,
  transformers' verbosity) and needs no state.
"""

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..errors import CollectiveDeviceError


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


def reducible_device_types(backend: str) -> frozenset[str]:
    """The device types whose tensors a process group of `backend` reduces.

    One backend name: torch's `torch.distributed.Backend.backend_capability` ("gloo": cpu and cuda, "nccl": cuda,
    "xccl": xpu; a name torch does not know: cpu and cuda, as torch assumes). A "device:backend" list such as
    "cpu:gloo,cuda:nccl" (accelerate's FSDP with offloading): the devices it names.

    Args:
        backend (`str`): what `torch.distributed.get_backend()` returns.

    Returns:
        `frozenset[str]`: device types, e.g. `frozenset({"cuda"})` for "nccl".
    """
    name = str(backend).lower()
    if ":" in name:
        return frozenset(pair.split(":")[0].strip() for pair in name.split(","))
    return frozenset(dist.Backend.backend_capability.get(name, ["cpu", "cuda"]))


def collective_device() -> torch.device:
    """The device this process keeps a counter on that it all-reduces (a count that belongs to no parameter).

    The CPU without a process group of several processes, or when the group's backend reduces CPU tensors (gloo,
    mpi, "cpu:gloo,cuda:nccl"); else the backend's accelerator (NCCL: CUDA) at index LOCAL_RANK mod the number of
    its devices, the device accelerate's `PartialState` and the Trainer give the process (the current device when
    LOCAL_RANK is unset).

    Returns:
        `torch.device`: e.g. `cpu` under gloo, `cuda:1` under NCCL on the second process of a node.
    """
    if process_rank_and_count()[1] == 1:
        return torch.device("cpu")
    types = reducible_device_types(dist.get_backend())
    if "cpu" in types:
        return torch.device("cpu")
    kind = sorted(types)[0]
    module = torch.get_device_module(kind)
    local = int(os.environ["LOCAL_RANK"]) if "LOCAL_RANK" in os.environ else module.current_device()
    count = module.device_count()
    return torch.device(kind, local % count if count else local)


@torch.no_grad()
def all_reduce_sum_(tensors: list[torch.Tensor], bucket_elements: int = 2**24) -> None:
    """In place: every tensor becomes the sum of its copies over all processes, x <- sum_p x_p.

    The tensors must all sit on one device, checked on any number of processes; under a process group that device
    must be one its backend reduces (`reducible_device_types`; NCCL: CUDA). Tensors of each dtype, in order of
    first appearance (the same on every process), are flattened into buckets of at most `bucket_elements` elements
    (one larger tensor alone), so that there are few collectives, bounded extra memory and no dtype promotion.

    Args:
        tensors (`list[torch.Tensor]`): the same shapes, dtypes and order on every process.
        bucket_elements (`int`, *optional*, defaults to 2**24): the largest flat bucket.

    Raises:
        CollectiveDeviceError: the tensors sit on several devices, or on one the process group's backend cannot
            reduce (nothing is reduced or changed).
    """
    device = _one_device(tensors)
    if device is None or process_rank_and_count()[1] == 1:
        return
    backend = dist.get_backend()
    if device.type not in reducible_device_types(backend):
        raise CollectiveDeviceError(
            f"all_reduce_sum_ got tensors on {device}, which the process group's backend {backend!r} cannot "
            f"reduce (it reduces {sorted(reducible_device_types(backend))} tensors). Keep sums beside their "
            f"parameters and counters on collective_device() ({collective_device()} here)."
        )
    for bucket in _buckets(tensors, bucket_elements):
        flat = torch.cat([t.reshape(-1) for t in bucket])
        dist.all_reduce(flat)
        for t, part in zip(bucket, flat.split([t.numel() for t in bucket]), strict=True):
            t.copy_(part.view_as(t))


def _one_device(tensors: list[torch.Tensor]) -> torch.device | None:
    """The one device of `tensors` (None for no tensors); CollectiveDeviceError naming the devices when several."""
    devices = list(dict.fromkeys(t.device for t in tensors))
    if len(devices) > 1:
        raise CollectiveDeviceError(
            f"all_reduce_sum_ got tensors on {len(devices)} devices ({', '.join(map(str, devices))}): one "
            "collective reduces tensors of one device (NCCL: CUDA tensors only). Call it once per device: sums "
            "beside their parameters, counters that belong to no parameter on collective_device()."
        )
    return devices[0] if devices else None


def _buckets(tensors: list[torch.Tensor], bucket_elements: int) -> list[list[torch.Tensor]]:
    """`tensors` grouped by dtype (in order of first appearance), each group cut in order into runs of at most
    `bucket_elements` elements (a larger tensor alone)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    buckets: list[list[torch.Tensor]] = []
    for group in by_dtype.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for t in group:
            if bucket and size + t.numel() > bucket_elements:
                buckets.append(bucket)
                bucket, size = [], 0
            bucket.append(t)
            size += t.numel()
        buckets.append(bucket)
    return buckets
