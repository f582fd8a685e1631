"""Refuse the training layouts CFP cannot correct, before anything is bound."""

import torch
from torch.distributed.fsdp import FullyShardedDataParallel

from . import deepspeed
from .fsdp1 import flat_pieces


def refuse_unsupported_layout(model: torch.nn.Module, args=None, optimizer=None) -> None:
    """Raise CFPError for training layouts CFP cannot correct yet, instead of correcting wrongly.

    DeepSpeed without its ZeRO optimizer at hand or with NVMe offload (its fp32 master partitions
    would overwrite the correction at the next step; `deepspeed.check_supported`), and FSDP1 with
    hybrid sharding or NO_SHARD flat parameters (`fsdp1.flat_pieces`). Plain, DDP, FSDP2
    (`fully_shard`), FSDP1 (use_orig_params True or False) and DeepSpeed ZeRO-1/2/3 models pass.
    """
    if deepspeed.uses_deepspeed(model, args):
        deepspeed.check_supported(model, optimizer)
    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        flat_pieces(model)
