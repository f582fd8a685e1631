"""The scoring pass that feeds an estimate's sinks, knowing no geometry.

`estimate_fisher` scores every group of samples a process draws once (`add`). The pass hands what it computes to the
sinks of the anchor's structure (`geometry.registry.structure`, `geometry.base.EstimateSink`): the per-sequence
squared scores of the parameters a sink sums squares of, and the layer inputs and output gradients of the weights a
sink sums them of, in one run of the engine ("batched", or "loop", the plain reference). Then one all-reduce of
`reduced()` (on the parameters' device) and one of `counts()` (on `parallel.collective_device()`), a second pass
over the scored groups for the sinks that ask for one (`refine`), and `finish()`: the anchor's parts.
"""

from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..geometry import structure
from ..geometry.base import EstimatePart, EstimatePlan, EstimateSink, LayerSums, Scored
from .batched import add_batched_squared_scores
from .module_kinds import layer_kind
from .sampling import Sampler
from .scoring import add_squared_score, sequence_log_prob


def scored_parameters(model: nn.Module, named: Sequence[tuple[str, torch.Tensor]]) -> list[Scored]:
    """The parameters `named` as the sinks see them (`geometry.base.Scored`): each with the layer kind and module of
    the one module that owns it as its weight (`module_kinds.layer_kind`), when there is one."""
    owners: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        for _, own in module.named_parameters(recurse=False):
            owners.setdefault(id(own), []).append(module)
    scored = []
    for name, p in named:
        found = owners.get(id(p), [])
        kind = layer_kind(found[0]) if len(found) == 1 and found[0].weight is p else None
        scored.append(Scored(name, p, kind, found[0] if kind is not None else None))
    return scored


def structure_sinks(name: str, scored: Sequence[Scored], plan: EstimatePlan) -> list[EstimateSink]:
    """The sinks of structure `name` over the scored parameters: each geometry after the first claims its part of
    what the ones before it left, the first takes the rest (`geometry.registry`); in the registry's order."""
    first, *others = structure(name)
    left, claimed = list(scored), []
    for geometry in others:
        mine = geometry.claim(left)
        taken = {id(s.param) for s in mine}
        left = [s for s in left if id(s.param) not in taken]
        claimed.append(geometry.sink(mine, plan))
    return [first.sink(left, plan), *claimed]


def _loop_engine(model, params, sums, prompts, responses, sampler, pad_id, supports, layers=None) -> None:
    """The plain reference: one forward and backward per sequence, each token scored on its support; the
    layer sums of the `layers` weights (their sums entry is None) from the batched engine's hooks on one
    sequence at a time."""
    squared = [i for i, s in enumerate(sums) if s is not None]
    factored = list(layers or {})
    for prompt, response, support in zip(prompts, responses, supports, strict=True):
        log_prob = sequence_log_prob(model, prompt, response, sampler, support)
        add_squared_score([sums[i] for i in squared], [params[i] for i in squared], log_prob)
        if factored:
            add_batched_squared_scores(
                model,
                [params[i] for i in factored],
                [None] * len(factored),  # type: ignore[list-item]  # no squares for the factored weights
                [prompt],
                [response],
                sampler,
                pad_id,
                supports=[support],
                layers={j: layers[i] for j, i in enumerate(factored)} if layers else None,
            )


ENGINE_FUNCTIONS: dict[str, Callable[..., None]] = {"batched": add_batched_squared_scores, "loop": _loop_engine}


class ScoringPass:
    """The groups of one estimate scored into its sinks by `engine` ("batched" or "loop") under `sampler`."""

    def __init__(self, sinks: list[EstimateSink], engine: str, sampler: Sampler, pad_id: int):
        self.sinks, self.score, self.sampler, self.pad_id = sinks, ENGINE_FUNCTIONS[engine], sampler, pad_id
        self.params = [p for sink in sinks for p in sink.params]
        self.groups: list[tuple[list, list, list]] | None = [] if any(s.replays for s in sinks) else None

    def add(self, model, prompts: list, responses: list, supports: list, first_half: bool) -> None:
        """Score one group of samples (of the first or the second half of the sequences) into every sink."""
        squares = [pair for sink in self.sinks for pair in sink.squares(first_half)]
        layers = [pair for sink in self.sinks for pair in sink.layers()]
        self._run(model, squares, layers, prompts, responses, supports)
        for sink in self.sinks:
            sink.positions(sum(len(p) + len(r) for p, r in zip(prompts, responses, strict=True)))
        if self.groups is not None:
            self.groups.append((prompts, responses, supports))

    def _run(self, model, squares, layers: list[tuple[torch.Tensor, LayerSums]], prompts, responses, supports):
        """One run of the engine: squared scores into `squares`' accumulators, layer sums into `layers`'."""
        params = [*(p for p, _ in squares), *(w for w, _ in layers)]
        accumulators = [*(a for _, a in squares), *([None] * len(layers))]
        by_index = {len(squares) + j: sums for j, (_, sums) in enumerate(layers)} or None
        self.score(
            model,
            params,
            accumulators,
            prompts,
            responses,
            self.sampler,
            self.pad_id,
            supports=supports,
            layers=by_index,
        )

    def reduced(self) -> list[torch.Tensor]:
        """The sums to add across processes, beside the parameters."""
        return [t for sink in self.sinks for t in sink.reduced()]

    def counts(self) -> list[torch.Tensor]:
        """The counters to add across processes, on `parallel.collective_device()`."""
        return [t for sink in self.sinks for t in sink.counts()]

    def refine(self, model) -> list[torch.Tensor]:
        """The second pass over the groups this process scored, for the sinks' `refine` layers (after the first
        pass's sums were all-reduced). Returns their sums, to be all-reduced before `finish`; [] when no sink asks
        for one (nothing is scored)."""
        layers = [pair for sink in self.sinks for pair in sink.refine()]
        if layers and self.groups:
            for prompts, responses, supports in self.groups:
                self._run(model, [], layers, prompts, responses, supports)
        self.groups = None
        return [t for sink in self.sinks for t in sink.refined()]

    def finish(self) -> list[EstimatePart]:
        """Every sink's part of the anchor, in order."""
        return [sink.finish() for sink in self.sinks]
