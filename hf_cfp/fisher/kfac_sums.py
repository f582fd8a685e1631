"""The sums of a K-FAC estimate: diagonal squares for most parameters, Kronecker factors for Linear-like weights
(`kfac_factors` states the factors), from the same scoring passes."""

from collections.abc import Callable, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers.pytorch_utils import Conv1D

from ..anchor.kfac import with_tails
from ..ops.kfac import KroneckerBasis
from ..parallel import collective_device
from .accumulators import DiagonalSums
from .kfac_factors import DenseFactor, KroneckerSums, SketchedFactor, Spectrum, kfac_kind


def kfac_weights(model: nn.Module, named: Sequence[tuple[str, torch.Tensor]]) -> dict[str, nn.Module]:
    """The covered weights that carry Kronecker factors, by name, with their module, in `named`'s order: the
    weight of a `kfac_kind` module that no other module owns (a weight tied to an embedding, GPT-2's lm_head, is
    used as a lookup too, and keeps a diagonal F like every other covered parameter), whatever its width (a factor
    too wide to form is sketched, `kfac_factors`)."""
    owners: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        for _, own in module.named_parameters(recurse=False):
            owners.setdefault(id(own), []).append(module)
    factored: dict[str, nn.Module] = {}
    for name, p in named:
        found = owners.get(id(p), [])
        if len(found) == 1 and kfac_kind(found[0]) is not None and found[0].weight is p:
            factored[name] = found[0]
    return factored


class KroneckerFisherSums:
    """The sums of a K-FAC estimate (a `FisherSums`, see `accumulators`): the diagonal sums of every covered
    parameter that is not a K-FAC weight (`DiagonalSums`, with its split-half statistics) and the factor sums of
    each K-FAC weight, added by the same scoring passes (the engines' `kronecker` argument); T, the unpadded
    positions scored, is counted beside them. `finish` divides (A = S_A / T, G = S_G / N) and decomposes each
    factor into its top `rank` eigenpairs and its tail (`kfac_factors`; consecutive equal factors, such as the
    input factor of q, k and v projections, are decomposed once), with a progress bar when `show_progress`."""

    def __init__(
        self,
        model: nn.Module,
        named: Sequence[tuple[str, torch.Tensor]],
        diagonal: Callable[[list[tuple[str, torch.Tensor]]], DiagonalSums],
        rank: int | None,
        anchor_name: str,
        show_progress: bool = False,
    ):
        factored = kfac_weights(model, named)
        self.diagonal = diagonal([(n, p) for n, p in named if n not in factored])
        self.names = list(factored)
        self.weights: list[torch.Tensor] = [m.weight for m in factored.values()]  # type: ignore[misc]
        self.sums = [
            KroneckerSums.zeros(*_in_and_out(m), w.device, rank)
            for m, w in zip(factored.values(), self.weights, strict=True)
        ]
        self.params = [*self.diagonal.params, *self.weights]
        self.tokens = torch.zeros(1, dtype=torch.float64, device=collective_device())  # T, a counter (`counts`)
        self.rank, self.anchor_name, self.show_progress = rank, anchor_name, show_progress
        sketched = any(isinstance(f, SketchedFactor) for s in self.sums for f in (s.inputs, s.outputs))
        self.scored: list[tuple[list, list, list]] | None = [] if sketched else None  # replayed by `refine`

    def add(self, model, prompts: list, responses: list, supports: list, first_half: bool) -> None:
        factored = list(zip(self.weights, self.sums, strict=True))
        self.diagonal.add(model, prompts, responses, supports, first_half, factored)
        self.tokens += sum(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
        if self.scored is not None:
            self.scored.append((prompts, responses, supports))

    def refine(self, model) -> list[torch.Tensor]:
        """One subspace iteration of every sketched factor (`kfac_sketch.FactorSketch.refined`: Omega <- orth(Y),
        after the sums were all-reduced): the groups this process scored are scored again with only the sketched
        factors summing. Returns their new sums, to be all-reduced before `finish`; [] when nothing is sketched
        (nothing is scored)."""
        if not self.scored:
            return []
        replay = [KroneckerSums(_Replay(s.inputs), _Replay(s.outputs)) for s in self.sums]  # type: ignore[arg-type]
        for prompts, responses, supports in self.scored:
            factored = list(zip(self.weights, replay, strict=True))
            self.diagonal.add(model, prompts, responses, supports, True, factored, squares=False)
        self.sums = [KroneckerSums(r.inputs.target, r.outputs.target) for r in replay]  # type: ignore[attr-defined]
        self.scored = None
        factors = [f for r in replay for f in (r.inputs, r.outputs)]
        return [t for f in factors if f.sketched for t in f.target.tensors()]  # type: ignore[attr-defined]

    def reduced(self) -> list[torch.Tensor]:
        return [*self.diagonal.reduced(), *(t for s in self.sums for t in s.tensors())]

    def counts(self) -> list[torch.Tensor]:
        """[T], the positions scored, on `parallel.collective_device()`."""
        return [self.tokens]

    def finish(self) -> tuple[dict[str, torch.Tensor], dict[str, KroneckerBasis], dict | None]:
        """(the diagonal F by name, the K-FAC weights' eigenbases by name, the diagonal part's split-half
        statistics)."""
        fisher, _, reliability = self.diagonal.finish()
        bases = {}
        last: tuple[torch.Tensor | None, Spectrum | None] = (None, None)
        weights = tqdm(
            zip(self.names, self.sums, strict=True),
            total=len(self.names),
            desc=f"K-FAC bases[{self.anchor_name}]",
            unit="weight",
            disable=not self.show_progress,
        )
        for name, sums in weights:  # the eigendecompositions: seconds per large factor on a CPU
            key = sums.inputs.tensors()[0]
            if last[0] is None or not torch.equal(key, last[0]):  # q, k and v projections read one input
                last = (key, sums.inputs.spectrum(float(self.tokens), self.rank, (name, "A", self.anchor_name)))
            output = sums.outputs.spectrum(self.diagonal.num_sequences, self.rank, (name, "G", self.anchor_name))
            bases[name] = with_tails(*last[1], *output)  # type: ignore[misc]
        self.sums = []
        return fisher, bases, reliability


class _Replay:
    """One factor in a refinement pass: a sketched factor's refined sketch (`SketchedFactor.refined`) sums the rows
    again; a dense factor, already complete, ignores them."""

    def __init__(self, factor: DenseFactor | SketchedFactor):
        self.target = factor.refined() if isinstance(factor, SketchedFactor) else factor

    @property
    def sketched(self) -> bool:
        return isinstance(self.target, SketchedFactor)

    def add(self, rows, gram) -> None:
        if self.sketched:
            self.target.add(rows, gram)


def _in_and_out(module: nn.Module) -> tuple[int, int]:
    """(in, out) features of a Linear-like module (nn.Linear's weight is out x in, Conv1D's in x out)."""
    rows, columns = module.weight.shape  # type: ignore[misc]
    return (rows, columns) if isinstance(module, Conv1D) else (columns, rows)
