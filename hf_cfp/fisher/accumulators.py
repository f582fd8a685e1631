"""What an estimate sums over its scored groups, adds across processes and turns into the anchor's tensors.

`estimate_fisher` drives a `FisherSums`: `add` for every group of samples a process scores, one all-reduce of
`reduced()` (on the parameters' device) and one of `counts()` (on `parallel.collective_device()`), then `finish()`.
`DiagonalSums` is the diagonal Fisher's: per parameter, the sums of squared per-sequence scores of the two halves of
the calibration sequences. Another structure of F (Kronecker factors summed in the batched engine's hooks beside the
squares) is another `FisherSums`.
"""

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import torch

from ..anchor.compare import split_half
from ..ops.kfac import KroneckerBasis
from .batched import add_batched_squared_scores
from .sampling import Sampler
from .scoring import add_squared_score, sequence_log_prob


class FisherSums(Protocol):
    """The running sums of an estimate."""

    params: list[torch.Tensor]  # the parameters scored (they need gradients while the estimate runs)

    def add(self, model, prompts: list, responses: list, supports: list, first_half: bool) -> None:
        """Add the scores of one group of samples (of the first or the second half of the sequences)."""
        ...

    def reduced(self) -> list[torch.Tensor]:
        """The sums added across processes (in place) before `finish`, each beside its parameter (one device)."""
        ...

    def counts(self) -> list[torch.Tensor]:
        """The counters added across processes (in place) before `finish`: float64, on
        `parallel.collective_device()`, all-reduced apart from the sums (a collective takes one device)."""
        ...

    def refine(self, model) -> list[torch.Tensor]:
        """A second pass over the scored groups where the first pass's sums ask for one (after they were
        all-reduced); returns the tensors to all-reduce again, [] when none."""
        ...

    def finish(self) -> tuple[dict[str, torch.Tensor], dict[str, KroneckerBasis], dict | None]:
        """(the anchor's diagonal F by parameter name, float32 on the CPU; the eigenbases of its Kronecker-factored
        weights, by name (none for a diagonal estimate); the split-half statistics, or None)."""
        ...


def _loop_engine(model, params, sums, prompts, responses, sampler, pad_id, supports, kronecker=None) -> None:
    """The plain reference: one forward and backward per sequence, each token scored on its support; the
    Kronecker factor sums of the `kronecker` weights (their sums entry is None) from the batched engine's hooks
    on one sequence at a time."""
    squared = [i for i, s in enumerate(sums) if s is not None]
    factored = list(kronecker or {})
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
                kronecker={j: kronecker[i] for j, i in enumerate(factored)} if kronecker else None,
            )


ENGINE_FUNCTIONS: dict[str, Callable[..., None]] = {"batched": add_batched_squared_scores, "loop": _loop_engine}


class DiagonalSums:
    """S_a and S_b, the sums over the sequences n < half and n >= half of (d/dtheta_i log mu(y_n | x_n))^2 per
    parameter (float32, beside it), added by `engine` ("batched" or "loop"); then

        F = (S_a + S_b) / N,  and the split-half statistics of F_a = S_a / N_a and F_b = S_b / N_b
        (`anchor.compare.split_half`; none when half = 0, and then S_a is not kept at all).
    """

    def __init__(
        self,
        named: Iterable[tuple[str, torch.Tensor]],
        num_sequences: int,
        half: int,
        engine: str,
        sampler: Sampler,
        pad_id: int,
    ):
        named = list(named)
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.num_sequences, self.half = num_sequences, half
        self.score, self.sampler, self.pad_id = ENGINE_FUNCTIONS[engine], sampler, pad_id
        self.second = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]  # S_b, then S = S_a + S_b
        self.first = [torch.zeros_like(s) for s in self.second] if half else []  # S_a: the one extra accumulator

    def add(
        self,
        model,
        prompts: list,
        responses: list,
        supports: list,
        first_half: bool,
        factored: Sequence[tuple[torch.Tensor, object]] = (),
        squares: bool = True,
    ) -> None:
        """Score one group of samples into the half's sums. `factored`: (weight, its `kfac_factors.KroneckerSums`)
        pairs the same pass sums Kronecker factors of (the engine's hooks; they get no squares); `squares=False`
        scores for them alone (a second pass over sketched factors)."""
        sums = self.first if first_half else self.second
        params = [*(self.params if squares else []), *(w for w, _ in factored)]
        accumulators = [*(sums if squares else []), *([None] * len(factored))]
        first = len(params) - len(factored)
        kronecker = {first + j: s for j, (_, s) in enumerate(factored)} or None
        self.score(
            model,
            params,
            accumulators,
            prompts,
            responses,
            self.sampler,
            self.pad_id,
            supports=supports,
            kronecker=kronecker,
        )

    def reduced(self) -> list[torch.Tensor]:
        return [*self.second, *self.first]

    def counts(self) -> list[torch.Tensor]:
        """No counters: the sequence counts are known to every process."""
        return []

    def refine(self, model) -> list[torch.Tensor]:
        """The diagonal sums are complete after one pass."""
        return []

    def finish(self) -> tuple[dict[str, torch.Tensor], dict[str, KroneckerBasis], dict | None]:
        """F by name, no bases, and the split-half statistics. S_a is released before F is moved to the CPU (the
        anchor's statistics need memory of their own)."""
        sums = self.second
        reliability = split_half(self.first, sums, self.half, self.num_sequences - self.half) if self.half else None
        if self.half:
            torch._foreach_add_(sums, self.first)
        self.first = []
        fisher = {n: s.div_(self.num_sequences).cpu() for n, s in zip(self.names, sums, strict=True)}
        return fisher, {}, reliability
