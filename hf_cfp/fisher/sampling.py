"""The sampler's own distribution, used both to draw responses and to score them.

Responses are drawn by `model.generate` (`sample_with_supports`); its logits processors are mu's warpers,
transformers' own, in the order generate applies them, then a recorder (`SupportRecorder`):

    mu(.|s) = renormalize(truncate_top_p(truncate_top_k(softmax(z / temperature))))

With temperature 1 and no truncation mu is the model's own pi. Scoring uses `Sampler.log_probs`, the same mu
written out (tested against plain Python and against the warpers), so the score d/dtheta log mu(y|x) is centered
under the distribution mu that drew y. generate gets a fresh `GenerationConfig` with every setting that shapes
the distribution given explicitly (`generation_config`): sampling, no warper of its own (mu's come as processors,
ahead of the recorder, which therefore sees the very scores generate draws from), no penalties, no minimum
length; a model whose generation config sets one that only None turns off is refused (`check_generation_config`).

The support S of a truncated mu is kept from sampling to scoring (the recorder, `pack_support`). Scoring runs
another forward (right-padded, no KV cache) whose logits differ from the sampling ones in the last bits;
recomputing S from them can move a token across the k-th or nucleus boundary (bf16 on a GPU makes near-ties
common), and a drawn token outside the recomputed S would get log mu = -inf and a finite, wrong score. The
estimator needs the score of the distribution that drew y, so scoring uses the sampling-time S with the
scoring-time logits:

    log mu_S(y) = z_y / T - log sum_{a in S} exp(z_a / T),    y in S,

differentiated with S held fixed -- the derivative of the truncated, renormalized distribution,
since S is piecewise constant in theta. Raising an error instead would stop an estimation at
every such near-tie; scoring against a recomputed S would be off-center even when y stays inside.

Randomness: generate draws from the global random state of the model's device. Each call forks it
(`seeded_rng`) and seeds it from one draw of the batch's own stream (`batch_generator(seed, k)`), so any split
of the batches over processes draws the same tokens, and the caller's random state is left as it was. The same
seed gives the same sequences on the same kind of device; a CPU and a GPU draw different ones. The sequences
differ from those drawn before sampling went through generate (issue 32; up to commit af1a428 each token was
drawn by `torch.multinomial` on the CPU from the stream itself): the same distribution, other tokens.
"""

import hashlib
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from ..errors import CFPArgumentError
from .generation import SupportRecorder, check_generation_config, generation_config, seeded_rng, until_eos


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class Sampler:
    """Ancestral sampling settings. `top_k=None` and `top_p=1.0` mean no truncation."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0

    def __post_init__(self):
        if not _is_number(self.temperature) or not self.temperature > 0:
            raise CFPArgumentError(
                f"temperature must be > 0, got {self.temperature!r}: a greedy sampler has no Fisher; use 1.0."
            )
        if self.top_k is not None and (
            not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 1
        ):
            raise CFPArgumentError(f"top_k must be None or an integer >= 1, got {self.top_k!r}.")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise CFPArgumentError(f"top_p must be in (0, 1], got {self.top_p!r}.")

    @property
    def truncates(self) -> bool:
        """Whether mu is truncated (top-k or top-p), so that its support is not the whole vocabulary."""
        return self.top_k is not None or self.top_p < 1.0

    def log_probs(self, logits: torch.Tensor, support: torch.Tensor | None = None) -> torch.Tensor:
        """log mu(a|s) over the last dimension; truncated tokens get -inf. Differentiable.

        support: optional bool mask shaped like `logits`, True on the tokens mu may draw (the support
        recorded when sampling, see the module docstring). Given, it replaces the top-k / top-p
        truncation recomputed from `logits`: log mu_S(a) = z_a/T - logsumexp_{b in S} z_b/T."""
        scores = logits.float() / self.temperature
        if support is not None:
            return scores.masked_fill(~support, float("-inf")).log_softmax(dim=-1)
        if self.top_k is not None and self.top_k < scores.shape[-1]:
            kth = scores.topk(self.top_k, dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth.detach(), float("-inf"))
        if self.top_p < 1.0:
            sorted_scores, order = scores.detach().sort(dim=-1, descending=True)
            mass_before = sorted_scores.softmax(dim=-1).cumsum(dim=-1) - sorted_scores.softmax(dim=-1)
            drop_sorted = mass_before >= self.top_p  # keep the smallest prefix reaching top_p (>= 1 token)
            drop = drop_sorted.scatter(-1, order, drop_sorted)
            scores = scores.masked_fill(drop, float("-inf"))
        return scores.log_softmax(dim=-1)

    def warpers(self) -> list[LogitsProcessor]:
        """mu as transformers' logits warpers, in the order generate applies them: z / temperature, then the top-k
        (`top_k` largest kept, ties at the k-th kept too), then the top-p (the smallest top set whose mass reaches
        `top_p`); those that change nothing are left out. softmax of their output is `log_probs(z).exp()`."""
        warpers: list[LogitsProcessor] = []
        if self.temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(self.temperature))
        if self.top_k is not None:
            warpers.append(TopKLogitsWarper(self.top_k))
        if self.top_p < 1.0:
            warpers.append(TopPLogitsWarper(self.top_p))
        return warpers

    def as_dict(self) -> dict:
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}


_BIT_VALUES = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def pack_support(mask: torch.Tensor) -> torch.Tensor:
    """A bool mask (..., V) packed 8 tokens a byte, (..., ceil(V / 8)) uint8: bit j of byte i is mask[8 i + j]."""
    bits = torch.nn.functional.pad(mask, (0, -mask.shape[-1] % 8)).unflatten(-1, (-1, 8)).to(torch.uint8)
    return (bits * _BIT_VALUES.to(bits.device)).sum(-1, dtype=torch.uint8)


def unpack_support(packed: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The inverse of `pack_support`: (..., ceil(V / 8)) uint8 -> bool mask (..., V), V = vocab_size."""
    bits = packed.unsqueeze(-1).bitwise_and(_BIT_VALUES.to(packed.device)) != 0
    return bits.flatten(-2)[..., :vocab_size]


def resolve_eos_ids(model, tokenizer, eos_token_id: int | list[int] | None = None) -> set[int]:
    """The token ids that end a response: `eos_token_id` if given, else the model's generation
    config's, else the tokenizer's; none (fixed-length responses) when all three are unset."""
    for source in (
        eos_token_id,
        getattr(getattr(model, "generation_config", None), "eos_token_id", None),
        getattr(tokenizer, "eos_token_id", None),
    ):
        if source is not None:
            return {int(t) for t in (source if isinstance(source, (list, tuple, set)) else [source])}
    return set()


def resolve_pad_id(tokenizer, eos_ids: set[int]) -> int:
    """The id written into padding positions (masked out): the tokenizer's pad token, else an EOS, else 0."""
    return getattr(tokenizer, "pad_token_id", None) or min(eos_ids, default=0)


def batch_generator(seed: int, batch_index: int) -> torch.Generator:
    """The random stream of batch `batch_index`: every batch has its own, derived from the seed,
    so that any split of the batches over processes draws the same tokens."""
    digest = hashlib.sha256(f"hf-cfp:{seed}:{batch_index}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


@dataclass(frozen=True)
class SamplingSettings:
    """Everything that fixes an estimate's on-policy draws, given the prompts: responses drawn from `sampler`'s mu,
    at most `max_new_tokens` tokens each, ending with the first token in `eos_ids`, prompts left-padded with
    `pad_id`, batch k from its own stream `batch_generator(seed, k)`. The scores use the same `sampler` and
    `pad_id` (the empirical estimator keeps the default `Sampler()` and draws nothing)."""

    sampler: Sampler
    max_new_tokens: int
    eos_ids: frozenset[int]
    pad_id: int
    seed: int

    @classmethod
    def resolve(
        cls, model, tokenizer, sampler: Sampler, max_new_tokens: int, eos_token_id: int | list[int] | None, seed: int
    ) -> "SamplingSettings":
        """The settings with the EOS ids and the pad id resolved from the arguments, the model and the tokenizer
        (`resolve_eos_ids`, `resolve_pad_id`)."""
        eos_ids = resolve_eos_ids(model, tokenizer, eos_token_id)
        return cls(sampler, max_new_tokens, frozenset(eos_ids), resolve_pad_id(tokenizer, eos_ids), seed)

    def draw(
        self, model, prompts: list[list[int]], batch_index: int, on_step: Callable[[int], object] | None = None
    ) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Batch `batch_index`'s responses to `prompts` and the supports they were drawn from
        (`sample_with_supports`)."""
        generator = batch_generator(self.seed, batch_index)
        return sample_with_supports(
            model, prompts, self.sampler, self.max_new_tokens, self.eos_ids, self.pad_id, generator, on_step
        )

    def as_dict(self) -> dict:
        """The sampler as recorded in an anchor's metadata: temperature, top_k, top_p and max_new_tokens."""
        return {**self.sampler.as_dict(), "max_new_tokens": self.max_new_tokens}


def sample_responses(
    model,
    prompts: list[list[int]],
    sampler: Sampler,
    max_new_tokens: int,
    eos_ids: Collection[int],
    pad_id: int,
    generator: torch.Generator,
) -> list[list[int]]:
    """Draw one response per prompt from mu: the responses of `sample_with_supports`."""
    return sample_with_supports(model, prompts, sampler, max_new_tokens, eos_ids, pad_id, generator)[0]


@torch.no_grad()
def sample_with_supports(
    model,
    prompts: list[list[int]],
    sampler: Sampler,
    max_new_tokens: int,
    eos_ids: Collection[int],
    pad_id: int,
    generator: torch.Generator,
    on_step: Callable[[int], object] | None = None,
) -> tuple[list[list[int]], list[torch.Tensor | None]]:
    """Draw one response per prompt from mu with `model.generate` on the model's device, prompts left-padded in
    one batch, and keep the support of mu each token was drawn from.

    y_t ~ mu(. | x, y_<t), mu = softmax of `sampler.warpers()` applied to the last logits; the random state is
    seeded from `generator` (`seeded_rng`). A response ends with (and includes) the first EOS token, or after
    `max_new_tokens`; the padding generate writes after it is not returned. supports[b] is None when the sampler
    does not truncate (the support is the whole vocabulary), else the packed masks (`pack_support`) of response
    b's tokens, uint8 (len(response), ceil(V / 8)) on the CPU: V / 8 bytes per drawn token, what scoring needs
    to use the same support. `on_step(k)`, if given, is called at every generation step with k, the number of
    responses that get a token at that step (so the k's sum to sum_b len(responses[b])): a progress bar moves
    with it.

    Raises:
        CFPArgumentError: `model` has no `generate`, or its generation config sets a setting that would change
            mu (`check_generation_config`).
    """
    check_generation_config(model)
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=device)
    recorder = SupportRecorder(width, eos, pack_support if sampler.truncates else None, on_step)
    with seeded_rng(generator, device):
        sequences = model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            generation_config=generation_config(max_new_tokens, eos_ids, pad_id),
            logits_processor=LogitsProcessorList([*sampler.warpers(), recorder]),
        )
    responses = [until_eos(row, eos_ids) for row in sequences[:, width:].tolist()]
    if not recorder.supports:
        return responses, [None] * len(prompts)
    packed = torch.stack(recorder.supports, dim=1).cpu()  # row b drew a token at every step until its EOS
    return responses, [packed[b, : len(r)] for b, r in enumerate(responses)]
