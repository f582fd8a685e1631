"""Kronecker factors of the anchor Fisher for Linear-like weights, accumulated from the batched engine's hooks.

For a weight W (out x in) of a module y_t = W a_t + c (nn.Linear; GPT-2 Conv1D stores W^T, the factors are those
of W^T's orientation, out x in) and N calibration sequences drawn on-policy, with positions t running over every
token fed to the scoring forward (prompt and response, padding excluded; T of them in all), a_{n,t} the layer's
input and g_{n,t} = d log mu(y_n | x_n) / d y_{n,t}:

    A = (1/T) sum_{n,t} a a^T   (in x in),      G = (1/N) sum_{n,t} g g^T   (out x out),      F_W ~ A (x) G.

The per-sequence score of W is sum_t g_t a_t^T; on-policy its cross-position terms vanish in expectation
(`on-policy-token-fisher`), which licenses pooling per-token statistics, and the normalization puts the diagonal
of A (x) G on the scale of the diagonal Fisher. The sums are kept in float32 (in^2 + out^2 numbers per weight,
no per-sequence gradient), added across processes like the diagonal sums, and turned into eigenbases once
(`anchor.kfac.basis_from_factors`).

Which weights: `kfac_kind` says which modules qualify (the stock nn.Linear and Conv1D forwards, both dimensions
at most `MAX_DIMENSION`: a vocabulary-sized lm_head keeps its diagonal F).
"""

from dataclasses import dataclass

import torch
from torch import nn

from .module_kinds import module_kind

MAX_DIMENSION = 16384  # a weight with a larger input or output keeps its diagonal F (e.g. lm_head: vocab x hidden)


def kfac_kind(module: nn.Module) -> str | None:
    """ "linear" or "conv1d" when `module`'s weight can carry Kronecker factors, else None."""
    kind = module_kind(module)
    if kind not in ("linear", "conv1d"):
        return None
    weight = module.weight
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or max(weight.shape) > MAX_DIMENSION:
        return None
    return kind


@dataclass
class KroneckerSums:
    """S_A = sum_{n,t} a a^T and S_G = sum_{n,t} g g^T of one weight, float32, on the weight's device."""

    a_sum: torch.Tensor
    g_sum: torch.Tensor

    @classmethod
    def zeros(cls, in_features: int, out_features: int, device: torch.device) -> "KroneckerSums":
        return cls(
            torch.zeros(in_features, in_features, dtype=torch.float32, device=device),
            torch.zeros(out_features, out_features, dtype=torch.float32, device=device),
        )

    def add_output_grads(self, g: torch.Tensor, mask: torch.Tensor) -> None:
        """S_G += sum over the unpadded positions of g g^T; g: (B, T, out)."""
        rows = g[mask].float()
        self.g_sum.addmm_(rows.T, rows)

    def tensors(self) -> list[torch.Tensor]:
        """The sums, for an all-reduce across processes."""
        return [self.a_sum, self.g_sum]

    def factors(self, num_tokens: float, num_sequences: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, G) = (S_A / T, S_G / N) on the CPU."""
        return (self.a_sum / num_tokens).cpu(), (self.g_sum / num_sequences).cpu()
