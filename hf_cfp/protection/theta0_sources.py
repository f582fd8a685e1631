"""Where a CFPState's theta0 comes from when it is not the weights now: the `Theta0Reader` protocol (a saved
theta0: `checkpoint.SavedTheta0`) and `Theta0Pieces`, theta0 pieces already in memory."""

from typing import TYPE_CHECKING, Protocol

import torch

from ..errors import CFPError
from .binding import HeldRange
from .peft_adapters import AdaptedWeight

if TYPE_CHECKING:
    from .state import CFPState


class Theta0Reader(Protocol):
    """Where a saved theta0 comes from (`checkpoint.SavedTheta0`)."""

    def read(self, wanted: list[tuple[str, HeldRange]]) -> dict[str, torch.Tensor]:
        """name -> the saved theta0 elements [start, stop) of each wanted parameter, flat."""
        ...

    def restore_lora(self, adapted: list[AdaptedWeight]) -> None:
        """Set each LoRA-adapted weight's snapshot (its factors at train begin) to the saved one."""
        ...


class Theta0Pieces:
    """theta0 pieces already in memory, by name, as a `Theta0Reader`: those of a bound CFPState (`of`: a CFPState
    binding other anchors to the same model, a refreshed F, keeps the path's origin, this process's pieces and
    the LoRA factors at train begin), or those of a `CFP.state_dict` (no LoRA factors: `snapshots` None).
    `source` names where they come from, for errors."""

    def __init__(self, theta0: dict[str, torch.Tensor], snapshots: dict[str, list] | None, source: str):
        self.theta0, self.snapshots, self.source = theta0, snapshots, source

    @classmethod
    def of(cls, state: "CFPState") -> "Theta0Pieces":
        snapshots = {weight.name: weight.snapshot for weight in state.adapted}
        return cls(dict(zip(state.names, state.theta0, strict=True)), snapshots, "the anchors bound before")

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
            weight.snapshot = self.snapshots[weight.name]
