"""What every geometry's LoRA rules share: one adapter's factors on one weight (`LoraFactors`). The rules that carry
a geometry's correction to them are its own (`diagonal.lora`, `kronecker.lora`)."""

from dataclasses import dataclass

import torch


@dataclass
class LoraFactors:
    """One adapter's factors on one weight, float32: scale s, B and A now; s0, B0, A0 at train begin."""

    scale: float
    b: torch.Tensor
    a: torch.Tensor
    scale0: float
    b0: torch.Tensor
    a0: torch.Tensor

    def displacement(self, b: torch.Tensor | None = None, a: torch.Tensor | None = None) -> torch.Tensor:
        """D = s B A - s0 B0 A0 (with B, A replaced by `b`, `a` when given)."""
        b = self.b if b is None else b
        a = self.a if a is None else a
        return torch.addmm(torch.mm(b, a), self.b0, self.a0, beta=self.scale, alpha=-self.scale0)
