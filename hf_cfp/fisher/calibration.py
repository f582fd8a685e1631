"""The calibration sequences of an estimate: which prompt each sequence has, which batches this process draws,
which half of the split-half statistics a sequence is in, and the groups of samples scored together."""

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

Item = TypeVar("Item")


@dataclass(frozen=True)
class CalibrationPlan:
    """The N = `num_sequences` calibration sequences and their split over processes and halves.

    Sequence n has the prompt x_n = prompts[(n // num_samples_per_prompt) % len(prompts)] (`cycled`) and lies in
    batch k = n // batch_size. Batch k is drawn and scored by process k % count (this one is `rank`), from a stream
    of its own, so any split of the batches gives the same sequences. The sequences n < `half` = ceil(N / 2)
    (N >= 2, else none) form the first half of the split-half statistics, the others the second.
    """

    num_sequences: int
    batch_size: int
    num_samples_per_prompt: int
    rank: int = 0
    count: int = 1

    @property
    def half(self) -> int:
        """The number of sequences in the first half: ceil(N / 2), or 0 when N < 2 (no split-half statistics)."""
        return math.ceil(self.num_sequences / 2) if self.num_sequences >= 2 else 0

    @property
    def batches(self) -> range:
        """The batch indices k of this process."""
        return range(self.rank, math.ceil(self.num_sequences / self.batch_size), self.count)

    def indices(self, k: int) -> range:
        """The sequences n of batch k."""
        return range(k * self.batch_size, min((k + 1) * self.batch_size, self.num_sequences))

    @property
    def sequences(self) -> int:
        """The number of sequences this process draws and scores."""
        return sum(len(self.indices(k)) for k in self.batches)

    def cycled(self, items: Sequence[Item], indices: range) -> list[Item]:
        """items[(n // num_samples_per_prompt) % len(items)] for every n in `indices`: the prompts of those
        sequences (or the given responses, one per prompt)."""
        return [items[(n // self.num_samples_per_prompt) % len(items)] for n in indices]

    def halves(self, indices: range) -> tuple[tuple[bool, slice], tuple[bool, slice]]:
        """(in the first half, the part of a batch's sequences `indices` in it) for the first half, then the
        second; either part may be empty."""
        cut = min(max(self.half - indices.start, 0), len(indices))
        return (True, slice(0, cut)), (False, slice(cut, None))


Group = tuple[list[list[int]], list[list[int]], list[torch.Tensor | None]]


@dataclass(frozen=True)
class ScoringGroups:
    """How the sequences of a batch are scored: as they are (the sequence estimator) or as one sample per response
    token (`per_token`, the token estimator: `one_token_samples`), cut into consecutive groups of at most
    `batch_size` samples and `scoring_tokens` padded tokens (`scoring_groups`), each scored in one forward and
    backward."""

    per_token: bool
    batch_size: int
    scoring_tokens: int

    def __call__(self, prompts: list, responses: list, supports: list) -> Iterator[Group]:
        """(prompts, responses, supports) of each group in turn."""
        if self.per_token:
            prompts, responses, supports = one_token_samples(prompts, responses, supports)
        for group in scoring_groups(prompts, responses, self.batch_size, self.scoring_tokens):
            yield prompts[group], responses[group], supports[group]


def scoring_groups(prompts, responses, batch_size: int, scoring_tokens: int) -> list[slice]:
    """Consecutive groups of sequences scored together: a group grows while it has at most batch_size
    sequences and (sequences x longest prompt + response) <= scoring_tokens, the padded tokens of its
    forward; a sequence longer than scoring_tokens is scored alone."""
    groups, start, width = [], 0, 0
    for n, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        grown = max(width, len(prompt) + len(response))
        if n > start and (n - start == batch_size or (n + 1 - start) * grown > scoring_tokens):
            groups.append(slice(start, n))
            start, grown = n, len(prompt) + len(response)
        width = grown
    if start < len(prompts):
        groups.append(slice(start, len(prompts)))
    return groups


def one_token_samples(prompts, responses, supports):
    """The token estimator's samples: (x + y_<t, [y_t]) for every response position t, so that
    sum over samples of squared scores = sum_n sum_t (d log mu(y_t | x, y_<t))^2; each keeps the
    support y_t was drawn from (row t of its response's supports, or None)."""
    samples = [
        (p + r[:t], [r[t]], None if s is None else s[t : t + 1])
        for p, r, s in zip(prompts, responses, supports, strict=True)
        for t in range(len(r))
    ]
    return [p for p, _, _ in samples], [r for _, r, _ in samples], [s for _, _, s in samples]
