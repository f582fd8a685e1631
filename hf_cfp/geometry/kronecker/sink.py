"""The Kronecker geometry's estimate sink: the factor sums of each Linear-like weight it claims (`factors` states
the factors), from the layer inputs and output gradients the scoring pass hands over, and T, the positions scored."""

from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from ...parallel import collective_device
from ..base import EstimatePart, EstimatePlan, LayerSums, Scored
from .artifact import with_tails
from .basis import KroneckerBasis
from .factors import DenseFactor, KroneckerSums, SketchedFactor, Spectrum


def kfac_weights(scored: Sequence[Scored]) -> list[Scored]:
    """The scored weights that carry Kronecker factors, in `scored`'s order: the 2-D weight of a layer that no other
    module owns (`base.Scored.layer`; a weight tied to an embedding, GPT-2's lm_head, is used as a lookup too, and
    keeps a diagonal F like every other covered parameter), whatever its width (a factor too wide to form is
    sketched, `factors`)."""
    return [s for s in scored if s.layer is not None]


class KroneckerSink:
    """The sums of the K-FAC weights of an estimate (a `base.EstimateSink`): S_A and S_G of each weight, added by
    the scoring passes, and T, the unpadded positions scored. `finish` divides (A = S_A / T, G = S_G / N) and
    decomposes each factor into its top `rank` eigenpairs and its tail (`factors`; consecutive equal factors, such
    as the input factor of q, k and v projections, are decomposed once), with a progress bar when `show_progress`.
    Factors too wide to form are sketched, and their sketches refined by a second pass over the scored groups."""

    def __init__(self, claimed: list[Scored], plan: EstimatePlan):
        self.names = [s.name for s in claimed]
        self.params: list[torch.Tensor] = [s.param for s in claimed]
        self.sums = [KroneckerSums.zeros(*_in_and_out(s), s.param.device, plan.rank) for s in claimed]
        self.tokens = torch.zeros(1, dtype=torch.float64, device=collective_device())  # T, a counter (`counts`)
        self.plan = plan
        self.replays = any(isinstance(f, SketchedFactor) for s in self.sums for f in (s.inputs, s.outputs))
        self._replay: list[KroneckerSums] = []

    def squares(self, first_half: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """None: a factored weight gets no squared scores."""
        return []

    def layers(self) -> list[tuple[torch.Tensor, LayerSums]]:
        return list(zip(self.params, self.sums, strict=True))

    def positions(self, count: int) -> None:
        self.tokens += count

    def refine(self) -> list[tuple[torch.Tensor, LayerSums]]:
        """One subspace iteration of every sketched factor (`sketch.FactorSketch.refined`: Omega <- orth(Y), after
        the sums were all-reduced): the weights' layer sums of a second pass over the groups this process scored,
        in which only the sketched factors sum. [] when nothing is sketched."""
        if not self.replays:
            return []
        self._replay = [KroneckerSums(_Replay(s.inputs), _Replay(s.outputs)) for s in self.sums]  # type: ignore[arg-type]
        return list(zip(self.params, self._replay, strict=True))

    def refined(self) -> list[torch.Tensor]:
        """The refined sketches' sums, to be all-reduced before `finish`; they replace the first pass's sums."""
        if not self._replay:
            return []
        replay, self._replay = self._replay, []
        self.sums = [KroneckerSums(r.inputs.target, r.outputs.target) for r in replay]  # type: ignore[attr-defined]
        factors = [f for r in replay for f in (r.inputs, r.outputs)]
        return [t for f in factors if f.sketched for t in f.target.tensors()]  # type: ignore[attr-defined]

    def reduced(self) -> list[torch.Tensor]:
        return [t for s in self.sums for t in s.tensors()]

    def counts(self) -> list[torch.Tensor]:
        """[T], the positions scored, on `parallel.collective_device()`."""
        return [self.tokens]

    def finish(self) -> EstimatePart:
        """The K-FAC weights' eigenbases by name, and the metadata `kfac_rank` and `num_tokens` (T)."""
        bases: dict[str, KroneckerBasis] = {}
        last: tuple[torch.Tensor | None, Spectrum | None] = (None, None)
        anchor, rank = self.plan.anchor_name, self.plan.rank
        weights = tqdm(
            zip(self.names, self.sums, strict=True),
            total=len(self.names),
            desc=f"K-FAC bases[{anchor}]",
            unit="weight",
            disable=not self.plan.show_progress,
        )
        for name, sums in weights:  # the eigendecompositions: seconds per large factor on a CPU
            key = sums.inputs.tensors()[0]
            if last[0] is None or not torch.equal(key, last[0]):  # q, k and v projections read one input
                last = (key, sums.inputs.spectrum(float(self.tokens), rank, (name, "A", anchor)))
            output = sums.outputs.spectrum(self.plan.num_sequences, rank, (name, "G", anchor))
            bases[name] = with_tails(*last[1], *output)  # type: ignore[misc]
        self.sums = []
        return EstimatePart(kfac=bases, metadata={"kfac_rank": rank, "num_tokens": float(self.tokens)})


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


def _in_and_out(scored: Scored) -> tuple[int, int]:
    """(in, out) features of a Linear-like weight (nn.Linear's weight is out x in, Conv1D's in x out)."""
    rows, columns = scored.param.shape
    return (rows, columns) if scored.layer == "conv1d" else (columns, rows)
