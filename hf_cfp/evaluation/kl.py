"""Capability KL to the base model, from responses drawn once from the base.

For prompts x_1..x_P of a capability and the sampler's distribution mu (tempered, not truncated),

    KL = (1/P) sum_p KL(mu_0(.|x_p) || mu_theta(.|x_p)),
    KL(mu_0(.|x) || mu_theta(.|x)) = E_{y ~ mu_0(.|x)} [ log mu_0(y|x) - log mu_theta(y|x) ],

estimated with m responses y_pj ~ mu_0(.|x_p) per prompt:

    KL_hat = (1/P) sum_p dbar_p,   dbar_p = (1/m) sum_j d_pj,   d_pj = log mu_0(y_pj|x_p) - log mu_theta(y_pj|x_p),
    stderr = sqrt( sum_p s_p^2 / m ) / P,   s_p^2 = (1/(m-1)) sum_j (d_pj - dbar_p)^2.

The prompts are fixed, so only the within-prompt spread counts; with m = 1 the spread of all d
about KL_hat is used instead (it includes the between-prompt spread: conservative).

Everything mu_theta is needed for is `log mu_theta(y_pj|x_p)` on the stored responses, so
`BaseResponses` (drawn once; token ids and base log-probs only) estimates the KL of any later
model with one scoring pass: no copy of the base model is kept.
"""

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..errors import CFPArgumentError
from ..fisher.sampling import Sampler, batch_generator, resolve_eos_ids, resolve_pad_id, sample_responses
from ..fisher.scoring import batched_sequence_log_probs
from ..fisher.token_ids import to_token_ids
from ..names import KL_TO_BASE, KL_TO_BASE_STDERR


@dataclass(frozen=True)
class KLEstimate:
    """KL_hat (nats) and its standard error, over `num_prompts` prompts x `num_samples_per_prompt` responses
    ([`kl_to_base_with_stderr`]).

    Args:
        kl (`float`): KL_hat = (1/(P m)) sum_p sum_j [log mu_0(y_pj|x_p) - log mu_theta(y_pj|x_p)], nats.
        stderr (`float`): its standard error, sqrt(sum_p s_p^2 / m) / P.
        num_prompts (`int`): P.
        num_samples_per_prompt (`int`): m.
    """

    kl: float
    stderr: float
    num_prompts: int
    num_samples_per_prompt: int

    def metrics(self, name: str) -> dict[str, float]:
        """The metrics `KLToBaseCallback` logs.

        Args:
            name (`str`): the capability's name in the keys.

        Returns:
            `dict[str, float]`: `cfp/<name>/kl_to_base` -> kl and `cfp/<name>/kl_to_base_stderr` -> stderr.
        """
        return {KL_TO_BASE.key(name): self.kl, KL_TO_BASE_STDERR.key(name): self.stderr}


def kl_estimate(base_log_probs: torch.Tensor, log_probs: torch.Tensor, num_samples_per_prompt: int) -> KLEstimate:
    """KL_hat and its stderr (module docstring) from log mu_0 and log mu_theta of the same responses,
    laid out prompt by prompt: responses p*m .. p*m + m - 1 belong to prompt p."""
    m = num_samples_per_prompt
    d = (base_log_probs.double() - log_probs.double()).reshape(-1, m)  # [P, m]
    num_prompts = d.shape[0]
    kl = float(d.mean())
    if m > 1:
        stderr = math.sqrt(float(d.var(dim=1, correction=1).sum()) / m) / num_prompts
    else:
        stderr = float(d.std(correction=1)) / math.sqrt(num_prompts) if num_prompts > 1 else float("nan")
    return KLEstimate(kl, stderr, num_prompts, m)


@dataclass(frozen=True)
class BaseResponses:
    """Responses y_pj ~ mu_0(.|x_p) and their base log-probs log mu_0(y_pj|x_p): all the KL of a later
    model to the base needs (token ids and one float per response; no weights)."""

    prompts: list[list[int]]  # the prompt of each response, x_p repeated m times in a row
    responses: list[list[int]]  # each ends at its first EOS, or after max_new_tokens
    base_log_probs: torch.Tensor  # float64 [P * m], on CPU
    num_samples_per_prompt: int
    sampler: Sampler
    pad_id: int
    batch_size: int

    def log_probs(self, model) -> torch.Tensor:
        """log mu_theta(y_pj|x_p) for every stored response: one scoring pass of `model` (eval mode, no
        grad, batches of `batch_size`; its train/eval mode is restored). Float64 [P * m] on CPU."""
        return score_responses(model, self.prompts, self.responses, self.sampler, self.pad_id, self.batch_size)

    def kl(self, model) -> KLEstimate:
        """KL_hat(mu_0 || mu_theta) with its stderr, theta = `model`'s current weights."""
        return kl_estimate(self.base_log_probs, self.log_probs(model), self.num_samples_per_prompt)

    def to_dict(self) -> dict[str, Any]:
        """The responses as JSON-ready values (`from_dict` reads them back; the log-probs exactly)."""
        return {
            "prompts": self.prompts,
            "responses": self.responses,
            "base_log_probs": self.base_log_probs.tolist(),
            "num_samples_per_prompt": self.num_samples_per_prompt,
            "sampler": asdict(self.sampler),
            "pad_id": self.pad_id,
            "batch_size": self.batch_size,
        }

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "BaseResponses":
        """The `BaseResponses` that `to_dict` wrote."""
        return cls(
            prompts=[list(p) for p in values["prompts"]],
            responses=[list(r) for r in values["responses"]],
            base_log_probs=torch.tensor(values["base_log_probs"], dtype=torch.float64),
            num_samples_per_prompt=int(values["num_samples_per_prompt"]),
            sampler=Sampler(**values["sampler"]),
            pad_id=int(values["pad_id"]),
            batch_size=int(values["batch_size"]),
        )


def score_responses(model, prompts, responses, sampler: Sampler, pad_id: int, batch_size: int) -> torch.Tensor:
    """[log mu(y_n|x_n)] for every pair, response tokens only, in batches of `batch_size`."""
    was_training = model.training
    model.eval()
    try:
        parts = [
            batched_sequence_log_probs(
                model, prompts[i : i + batch_size], responses[i : i + batch_size], sampler, pad_id
            )
            for i in range(0, len(prompts), batch_size)
        ]
    finally:
        model.train(was_training)
    return torch.cat(parts)


def draw_base_responses(
    base_model,
    tokenizer,
    prompts,
    num_samples_per_prompt: int = 4,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    seed: int = 0,
    *,
    batch_size: int = 8,
    eos_token_id: int | list[int] | None = None,
) -> BaseResponses:
    """Draw m = `num_samples_per_prompt` responses per prompt from mu_0 (the base model's tempered
    sampler) and score them under the base: the `BaseResponses` of the module docstring.

    Response n (n = 0 .. P*m - 1) answers prompt n // m and lies in batch k = n // batch_size, drawn
    from the stream `batch_generator(seed, k)` with `sample_responses`: the sampler, batching and
    random streams of `estimate_fisher(..., num_sequences=P*m, num_samples_per_prompt=m)`.
    """
    for argument, value, least in (
        ("num_samples_per_prompt", num_samples_per_prompt, 1),
        ("max_new_tokens", max_new_tokens, 1),
        ("batch_size", batch_size, 1),
        ("seed", seed, 0),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise CFPArgumentError(f"{argument} must be an integer >= {least}, got {value!r}.")
    sampler = Sampler(temperature)  # no top-k / top-p: a truncated mu_theta could give a drawn y probability 0
    prompt_ids = to_token_ids(prompts, tokenizer)
    eos_ids = resolve_eos_ids(base_model, tokenizer, eos_token_id)
    pad_id = resolve_pad_id(tokenizer, eos_ids)
    paired = [prompt for prompt in prompt_ids for _ in range(num_samples_per_prompt)]
    responses: list[list[int]] = []
    was_training = base_model.training
    base_model.eval()
    try:
        for k, start in enumerate(range(0, len(paired), batch_size)):
            batch = paired[start : start + batch_size]
            responses += sample_responses(
                base_model, batch, sampler, max_new_tokens, eos_ids, pad_id, batch_generator(seed, k)
            )
    finally:
        base_model.train(was_training)
    base_log_probs = score_responses(base_model, paired, responses, sampler, pad_id, batch_size)
    return BaseResponses(paired, responses, base_log_probs, num_samples_per_prompt, sampler, pad_id, batch_size)


def kl_to_base_with_stderr(
    base_model,
    model,
    tokenizer,
    prompts,
    num_samples_per_prompt: int = 4,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    seed: int = 0,
    *,
    batch_size: int = 8,
    eos_token_id: int | list[int] | None = None,
) -> KLEstimate:
    """`kl_to_base` with its standard error, stderr = sqrt(sum_p s_p^2 / m) / P (s_p^2: the sample variance of
    prompt p's m log-ratios log mu_0(y|x_p) - log mu_theta(y|x_p)).

    Args:
        base_model, model, tokenizer, prompts, num_samples_per_prompt, max_new_tokens, temperature, seed,
        batch_size, eos_token_id: as in [`kl_to_base`].

    Returns:
        [`KLEstimate`]: `kl` (nats), `stderr`, `num_prompts` and `num_samples_per_prompt`.

    Raises:
        CFPArgumentError: as [`kl_to_base`].
    """
    base = draw_base_responses(
        base_model,
        tokenizer,
        prompts,
        num_samples_per_prompt,
        max_new_tokens,
        temperature,
        seed,
        batch_size=batch_size,
        eos_token_id=eos_token_id,
    )
    return base.kl(model)


def kl_to_base(
    base_model,
    model,
    tokenizer,
    prompts,
    num_samples_per_prompt: int = 4,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    seed: int = 0,
    *,
    batch_size: int = 8,
    eos_token_id: int | list[int] | None = None,
) -> float:
    """Sequence-level KL of `model` from `base_model` on a capability's prompts, in nats:

        KL = (1/P) sum_p E_{y ~ mu_0(.|x_p)} [ log mu_0(y|x_p) - log mu_theta(y|x_p) ]
           ~ (1/(P m)) sum_p sum_j ( log mu_0(y_pj|x_p) - log mu_theta(y_pj|x_p) ),  y_pj ~ mu_0(.|x_p),

    with log mu(y|x) = sum_t log mu(y_t | x, y_<t) over the response tokens only. mu is the sampler at
    `temperature` T for both models, mu(a|s) = softmax(z(s) / T)_a: at T != 1 this is the KL between
    the *tempered* policies, KL(mu_0^T || mu_theta^T), the same T scoring both. No top-k / top-p, so
    every y mu_0 draws has mu_theta(y|x) > 0 and the KL is finite.

    A response ends with (and includes) its first EOS token; one that reaches `max_new_tokens`
    without EOS is the event "the first max_new_tokens tokens are y", scored the same way under
    both models, so mu_0 and mu_theta are distributions over the same finite set of responses
    and this is their exact KL (the KL of the max_new_tokens-truncated process). The responses,
    prompt forms and random streams are those of `estimate_fisher` (see `draw_base_responses`);
    `kl_to_base(base, base)` is exactly 0. `kl_to_base_with_stderr` also returns the standard error.

    Args:
        base_model: the reference policy mu_0 (drawn from and scored).
        model: the policy mu_theta (scored only); e.g. the trained model, a PeftModel included.
        tokenizer: needed for text or chat prompts (and supplies EOS / pad ids); None for token-id prompts.
        prompts: strings (chat models get their chat template), chat message lists, token-id lists,
            or a `datasets.Dataset` with a `prompt` column; P prompts.
        num_samples_per_prompt: m responses per prompt.
        max_new_tokens: longest response.
        temperature: T of the sampler both models are compared under.
        seed: the same seed and batch_size give the same responses.
        batch_size: responses sampled and scored together.
        eos_token_id: ends a response; default the base model's generation config, then the tokenizer's.

    Returns:
        `float`: KL_hat in nats (0 exactly for `kl_to_base(base, base)`).

    Raises:
        CFPArgumentError: a non-positive count or negative seed, a bad temperature, no prompts, text prompts
            without a tokenizer, or a dataset without a `prompt` column.
    """
    return kl_to_base_with_stderr(
        base_model,
        model,
        tokenizer,
        prompts,
        num_samples_per_prompt,
        max_new_tokens,
        temperature,
        seed,
        batch_size=batch_size,
        eos_token_id=eos_token_id,
    ).kl
