"""The sampler's own distribution, used both to draw responses and to score them.

Drawing and scoring go through the same `Sampler.log_probs`, so the score
d/dtheta log mu(y|x) is centered under the distribution mu that drew y:

    mu(.|s) = renormalize(truncate_top_p(truncate_top_k(softmax(z / temperature))))

(temperature, then top-k, then top-p, the order transformers applies them). With
temperature 1 and no truncation mu is the model's own pi.
"""

import hashlib
import inspect
from dataclasses import dataclass

import torch

from ..errors import CFPArgumentError


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

    def log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """log mu(a|s) over the last dimension; truncated tokens get -inf. Differentiable."""
        scores = logits.float() / self.temperature
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

    def as_dict(self) -> dict:
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}


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


@torch.no_grad()
def sample_responses(
    model,
    prompts: list[list[int]],
    sampler: Sampler,
    max_new_tokens: int,
    eos_ids: set[int],
    pad_id: int,
    generator: torch.Generator,
) -> list[list[int]]:
    """Draw one response per prompt from mu with a KV cache, prompts left-padded in one batch.

    A response ends with (and includes) the first EOS token, or after `max_new_tokens`.
    """
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    responses: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    # transformers 5 renamed the KV-cache argument and output from `past_key_values` to `cache`.
    cache_name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache, step_ids = None, input_ids
    for _ in range(max_new_tokens):
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1] :]
        out = model(
            input_ids=step_ids, attention_mask=mask, position_ids=positions, use_cache=True, **{cache_name: cache}
        )
        cache = getattr(out, cache_name, None)
        if cache is None:
            raise CFPArgumentError(
                f"{type(model).__name__} returned no KV cache ({cache_name!r}) with use_cache=True: on-policy "
                "sampling needs a causal LM that generates with a cache, e.g. an AutoModelForCausalLM."
            )
        probs = sampler.log_probs(out.logits[:, -1]).exp().cpu()
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(1).tolist()
        for row, token in enumerate(tokens):
            if not done[row]:
                responses[row].append(token)
                done[row] = token in eos_ids
        if all(done):
            break
        step_ids = torch.tensor(tokens, device=device).unsqueeze(1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    return responses
