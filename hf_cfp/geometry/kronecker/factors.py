"""Kronecker factors of the anchor Fisher for Linear-like weights, summed from the layer inputs and output gradients
the scoring pass hands over (`base.LayerSums`).

For a weight W (out x in) of a module y_t = W a_t + c (nn.Linear; GPT-2 Conv1D stores W^T, the factors are those
of W^T's orientation, out x in) and N calibration sequences drawn on-policy, with positions t running over every
token fed to the scoring forward (prompt and response, padding excluded; T of them in all), a_{n,t} the layer's
input and g_{n,t} = d log mu(y_n | x_n) / d y_{n,t}:

    A = (1/T) sum_{n,t} a a^T   (in x in),      G = (1/N) sum_{n,t} g g^T   (out x out),      F_W ~ A (x) G.

The per-sequence score of W is sum_t g_t a_t^T; on-policy its cross-position terms vanish in expectation
(`on-policy-token-fisher`), which licenses pooling per-token statistics, and the normalization puts the diagonal
of A (x) G on the scale of the diagonal Fisher. The sums are kept in float32 (in^2 + out^2 numbers per weight,
no per-sequence gradient; a sketch for factors too wide to form, below), added across processes like the
diagonal sums, and turned into eigenbases once.

Which weights: those the scoring pass can hand inputs and output gradients of (`fisher.module_kinds.layer_kind`:
the stock nn.Linear and Conv1D forwards with a 2-D weight), whatever their width, an untied vocabulary-sized
lm_head included (a tied one is an embedding lookup too and keeps its diagonal F, `sink.kfac_weights`). A factor
of dimension at most `MAX_FORMED_DIMENSION` is summed densely (`DenseFactor`, dim^2 floats) and decomposed exactly
(its top eigenpairs by subspace iteration when the rank is small beside its dimension); a wider one is never formed:
`SketchedFactor` streams a randomized sketch of it (`sketch.FactorSketch`, dim x l floats, l = rank + oversampling)
and its exact trace, and its top eigenpairs come from the sketch's Nystrom approximation after one more pass over
the scored sequences (`sink.KroneckerSink.refine`). Either way the factor keeps its top `rank` eigenpairs and the
mean of the rest as its tail (`artifact.truncated_spectrum`); a sketched factor needs a rank (`WIDE_RANK`
when none is given).
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from .artifact import checked_factor, eigenbasis, truncated_spectrum
from .sketch import FactorSketch, sketch_width, top_eigenpairs

MAX_FORMED_DIMENSION = 8192  # a wider factor (8192^2 float32 = 268 MB) is sketched, never formed
WIDE_RANK = 256  # the eigenpairs a sketched factor keeps when the estimate asks for all of them (kfac_rank=None)

Spectrum = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]  # (eigenvalues, eigenvectors, tail), float32


class FactorSums(Protocol):
    """What one factor's rows are added to: `rows()` (n x dim) or, for a dense sum, `gram()` =
    rows^T rows (formed once by the caller for an input several weights share)."""

    def add(self, rows: Callable[[], torch.Tensor], gram: Callable[[], torch.Tensor]) -> None: ...


class DenseFactor:
    """S = sum_t x x^T of one factor, dim x dim float32 on the weight's device."""

    def __init__(self, dim: int, device: torch.device):
        self.sum = torch.zeros(dim, dim, dtype=torch.float32, device=device)

    def add(self, rows: Callable[[], torch.Tensor], gram: Callable[[], torch.Tensor]) -> None:
        """S += gram() (rows^T rows, formed once by the caller for inputs several weights share)."""
        self.sum.add_(gram())

    def tensors(self) -> list[torch.Tensor]:
        return [self.sum]

    def spectrum(self, count: float, rank: int | None, where: tuple[str, str, str]) -> Spectrum:
        """The top `rank` eigenpairs (all when None) and the tail of X = S / count (`where`: weight name, "A" or
        "G", anchor name, for its errors): from the full `artifact.eigenbasis` when all are kept or the
        rank's `sketch_width` exceeds half the dimension, else by subspace iteration (`top_eigenpairs`, the
        trace exact): the full eigendecomposition was most of a rank-64 estimate's time."""
        name, which, anchor_name = where
        factor, dim = (self.sum / count).cpu(), self.sum.shape[0]
        if rank is None or 2 * sketch_width(dim, rank) > dim:
            return eigenbasis(name, which, factor, anchor_name, rank)
        matrix = checked_factor(name, which, factor, anchor_name)
        values, vectors = top_eigenpairs(matrix, rank)
        kept, tail = truncated_spectrum(values, float(matrix.trace()), dim, rank, "mean")
        return kept, vectors.float().contiguous(), tail


class SketchedFactor:
    """A factor too wide to form (`FactorSketch`: Y = S Omega and tr S, streamed)."""

    def __init__(self, sketch: FactorSketch):
        self.sketch = sketch

    def add(self, rows: Callable[[], torch.Tensor], gram: Callable[[], torch.Tensor]) -> None:
        """Y += rows^T (rows Omega), tr S += |rows|^2."""
        self.sketch.add(rows())

    def tensors(self) -> list[torch.Tensor]:
        return self.sketch.tensors()

    def refined(self) -> "SketchedFactor":
        """An empty factor for a second pass over the same rows (`FactorSketch.refined`)."""
        return SketchedFactor(self.sketch.refined())

    def spectrum(self, count: float, rank: int | None, where: tuple[str, str, str]) -> Spectrum:
        """The sketch's top `rank` eigenpairs of X = S / count and the tail (tr X - sum kept) / (dim - rank)."""
        values, vectors, trace = self.sketch.eigenpairs(count)
        keep = self.sketch.rank if rank is None else min(rank, self.sketch.rank)
        kept, tail = truncated_spectrum(values, trace, self.sketch.dim, keep, "mean")
        return kept, vectors[:, :keep].cpu().contiguous(), tail


def factor_sums(dim: int, rank: int | None, device: torch.device) -> DenseFactor | SketchedFactor:
    """The accumulator of one factor: dense up to `MAX_FORMED_DIMENSION`, else a sketch of `rank` (or
    `WIDE_RANK`) eigenpairs."""
    if dim <= MAX_FORMED_DIMENSION:
        return DenseFactor(dim, device)
    return SketchedFactor(FactorSketch(dim, rank or WIDE_RANK, device))


@dataclass
class KroneckerSums:
    """The input factor's sums (S_A = sum_{n,t} a a^T) and the output factor's (S_G = sum_{n,t} g g^T) of one
    weight, dense or sketched (`factor_sums`), on the weight's device."""

    inputs: FactorSums
    outputs: FactorSums

    @classmethod
    def zeros(
        cls, in_features: int, out_features: int, device: torch.device, rank: int | None = None
    ) -> "KroneckerSums":
        return cls(factor_sums(in_features, rank, device), factor_sums(out_features, rank, device))

    def add_inputs(self, rows: Callable[[], torch.Tensor], gram: Callable[[], torch.Tensor]) -> None:
        """S_A += gram() (or its sketch of rows()): the layer inputs at the unpadded positions (`base.LayerSums`)."""
        self.inputs.add(rows, gram)

    def add_output_grads(self, g: torch.Tensor, mask: torch.Tensor) -> None:
        """S_G += sum over the unpadded positions of g g^T; g: (B, T, out)."""
        rows = g[mask].float()
        self.outputs.add(lambda: rows, lambda: rows.T @ rows)

    def tensors(self) -> list[torch.Tensor]:
        """The sums, for an all-reduce across processes."""
        return [*self.inputs.tensors(), *self.outputs.tensors()]  # type: ignore[attr-defined]
