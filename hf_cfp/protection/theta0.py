"""Where a bound CFPState's theta0 comes from when it is not the weights now: a reader of saved pieces
(`checkpoint.SavedTheta0` for a Trainer checkpoint, `Theta0Pieces` for pieces in memory)."""

from typing import Protocol

import torch

from ..errors import CFPError
from ..geometry.binding import HeldRange
from .peft_adapters import AdaptedWeight


class Theta0Reader(Protocol):
    """Where a saved theta0 comes from (`checkpoint.SavedTheta0`)."""

    def read(self, wanted: list[tuple[str, HeldRange]]) -> dict[str, torch.Tensor]:
        """name -> the saved theta0 elements [start, stop) of each wanted parameter, flat."""
        ...

    def restore_lora(self, adapted: list[AdaptedWeight]) -> None:
        """Set each LoRA-adapted weight's snapshot (its factors at train begin) to the saved one."""
        ...


class Theta0Pieces:
    """theta0 pieces already in memory, by name, as a `Theta0Reader`: those of a bound CFPState
    (`CFPState.theta0_pieces`: a CFPState binding other anchors to the same model, a refreshed F, keeps the path's
    origin, this process's pieces and the LoRA factors at train begin), or those of a `CFP.state_dict` (LoRA
    factors on the CPU). `source` names where they come from, for errors."""

    def __init__(self, theta0: dict[str, torch.Tensor], snapshots: dict[str, list] | None, source: str):
        self.theta0, self.snapshots, self.source = theta0, snapshots, source

    def read(self, wanted: list[tuple[str, HeldRange]]) -> dict[str, torch.Tensor]:
        missing = [name for name, _ in wanted if name not in self.theta0]
        if missing:
            raise CFPError(
                f"No theta0 for {missing[0]!r} in {self.source}: they were taken for other parameters (another "
                "model, or anchors covering parameters the earlier ones did not)."
            )
        return {name: self.theta0[name].reshape(-1) for name, _ in wanted}

    def restore_lora(self, adapted: list[AdaptedWeight]) -> None:
        if self.snapshots is None:
            raise CFPError(f"{self.source} holds no LoRA factors at train begin: LoRA-adapted weights cannot resume.")
        for weight in adapted:
            saved = self.snapshots.get(weight.name)
            if saved is None or len(saved) != len(weight.snapshot):
                raise CFPError(
                    f"{self.source} holds no LoRA factors at train begin for {weight.name!r} with its "
                    f"{len(weight.snapshot)} active adapters: resume with the model and adapters of the original run."
                )
            weight.snapshot = [  # on the factors' device (a state_dict keeps them on the CPU)
                (s0, b0.to(b_now.device, torch.float32), a0.to(a_now.device, torch.float32))
                for (s0, b0, a0), (_, b_now, a_now) in zip(saved, weight.snapshot, strict=True)
            ]
