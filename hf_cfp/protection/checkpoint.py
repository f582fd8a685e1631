"""theta0 saved with each Trainer checkpoint, so a resumed run keeps the original path origin.

Disk cost per checkpoint: 4 bytes per covered trainable parameter (one float32 copy), in
`cfp_theta0.safetensors` (written by rank 0 when parameters are replicated), or one
`cfp_theta0-rank{r}-of-{n}.safetensors` per process holding its shards (FSDP, ZeRO-3).
"""

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..parallel import process_rank_and_count
from .state import CFPState

REPLICATED_NAME = "cfp_theta0.safetensors"


def _filename(sharded: bool) -> str:
    rank, count = process_rank_and_count()
    return f"cfp_theta0-rank{rank:05d}-of-{count:05d}.safetensors" if sharded else REPLICATED_NAME


def save_theta0(protection: CFPState, checkpoint_dir: str | Path) -> None:
    """Write this process's theta0 (`protection.theta0_state()`) into the checkpoint directory."""
    sharded = any(protection.sharded)
    if sharded or process_rank_and_count()[0] == 0:
        save_file(protection.theta0_state(), Path(checkpoint_dir) / _filename(sharded), metadata={"format": "pt"})


def load_theta0(checkpoint_dir: str | Path) -> dict[str, torch.Tensor] | None:
    """This process's saved theta0, or None when the checkpoint has none (saved without CFP)."""
    directory = Path(checkpoint_dir)
    for name in (_filename(sharded=True), REPLICATED_NAME):
        if (directory / name).is_file():
            return load_file(directory / name)
    return None
