"""Parallel layouts: process helpers and collectives, and which piece of each parameter a process
holds under DDP, FSDP2, FSDP1 and DeepSpeed ZeRO-1/2/3 (and its fp32 master copy).

Depends on the pure math in `hf_cfp.ops` only; protection binds anchors through it.
"""

from .layout import refuse_unsupported_layout
from .processes import all_reduce_sum_, collective_device, log_on_main_process, process_rank_and_count
from .shards import local_tensor

__all__ = [
    "all_reduce_sum_",
    "collective_device",
    "local_tensor",
    "log_on_main_process",
    "process_rank_and_count",
    "refuse_unsupported_layout",
]
