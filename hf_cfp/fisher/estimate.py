"""estimate_fisher: the anchor Fisher of a capability at the model's current weights."""

import contextlib
from datetime import datetime, timezone

import torch
from tqdm.auto import tqdm

from ..anchor import FisherAnchor
from ..errors import CFPArgumentError
from ..names import named_trainable_parameters
from .prompts import fingerprint, to_token_ids
from .sampling import Sampler, sample_responses
from .scoring import add_squared_score, sequence_log_prob

ESTIMATORS = ("sequence", "empirical")


def estimate_fisher(
    model,
    tokenizer,
    prompts,
    num_sequences: int = 128,
    max_new_tokens: int = 256,
    batch_size: int = 8,
    seed: int = 0,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    name: str = "anchor",
    *,
    estimator: str = "sequence",
    responses=None,
    trainable_only: bool = True,
    eos_token_id: int | list[int] | None = None,
    show_progress: bool = True,
) -> FisherAnchor:
    """Estimate the diagonal output Fisher of `model` on a capability's prompts.

    estimator="sequence" (default, on-policy): for n = 1..N, x_n = prompts[n % len(prompts)],
    y_n ~ mu(.|x_n) drawn from the model itself, and

        F_i = (1/N) sum_n ( d/dtheta_i log mu(y_n | x_n) )^2,

    the mean of per-sequence squared scores over response tokens only (the prompt is context,
    the response ends at its first EOS). mu is the sampler's own distribution: softmax(z/T),
    truncated to top-k / top-p and renormalized, so the score is centered under the sampler
    (mu = pi at temperature 1 without truncation). estimator="empirical" scores the given
    `responses` (labels) instead of samples: the *empirical* Fisher, a different quantity
    that is not centered under the model.

    Args:
        model: a causal LM (`model(input_ids).logits`); returned in its original train/eval mode,
            with no `.grad` written.
        tokenizer: needed for text or chat prompts; may be None for token-id prompts.
        prompts: strings (chat models get their chat template), chat message lists, token-id
            lists, or a `datasets.Dataset` with a `prompt` column.
        num_sequences: N, calibration sequences (the paper uses 128); prompts are cycled.
        max_new_tokens: longest response.
        batch_size: responses sampled together (left-padded, KV cache); each is scored alone.
        seed: the same seed and batch_size give the same anchor bit for bit.
        temperature, top_k, top_p: the sampler (explicit; the model's generation config is ignored).
        name: the capability name, used in metric keys.
        responses: for estimator="empirical", one response (text or token ids) per prompt.
        trainable_only: cover only parameters with requires_grad (default).
        eos_token_id: ends a response; default the model's generation config, then the tokenizer's.
    """
    if estimator not in ESTIMATORS:
        raise CFPArgumentError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}.")
    for argument, value in (("num_sequences", num_sequences), ("max_new_tokens", max_new_tokens),
                            ("batch_size", batch_size), ("seed", seed)):
        if not isinstance(value, int) or isinstance(value, bool) or value < (0 if argument == "seed" else 1):
            raise CFPArgumentError(f"{argument} must be an integer >= {0 if argument == 'seed' else 1}, got {value!r}.")
    sampler = Sampler(temperature, top_k, top_p) if estimator == "sequence" else Sampler()
    prompt_ids = to_token_ids(prompts, tokenizer)
    labels = _labels(responses, tokenizer, len(prompt_ids), estimator)
    eos_ids = _eos_ids(model, tokenizer, eos_token_id)
    pad_id = getattr(tokenizer, "pad_token_id", None) or min(eos_ids, default=0)

    named = list(named_trainable_parameters(model, trainable_only))
    params = [p for _, p in named]
    sums = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    generator = torch.Generator().manual_seed(seed)
    response_tokens = 0
    was_training = model.training
    model.eval()
    try:
        with _requires_grad(params), tqdm(total=num_sequences, desc=f"Fisher[{name}]", unit="seq",
                                          disable=not show_progress) as progress:
            for start in range(0, num_sequences, batch_size):
                batch = [prompt_ids[n % len(prompt_ids)] for n in range(start, min(start + batch_size, num_sequences))]
                if labels is None:
                    drawn = sample_responses(model, batch, sampler, max_new_tokens, eos_ids, pad_id, generator)
                else:
                    drawn = [labels[n % len(labels)] for n in range(start, start + len(batch))]
                for prompt, response in zip(batch, drawn):
                    add_squared_score(sums, params, sequence_log_prob(model, prompt, response, sampler))
                    response_tokens += len(response)
                    progress.update(1)
    finally:
        model.train(was_training)

    fisher = {n: s.div_(num_sequences).cpu() for (n, _), s in zip(named, sums)}
    metadata = {
        "base_model": getattr(model.config, "_name_or_path", None) or None,
        "base_model_revision": getattr(model.config, "_commit_hash", None),
        "estimator": estimator,
        "sampler": {**sampler.as_dict(), "max_new_tokens": max_new_tokens} if labels is None else None,
        "num_sequences": num_sequences,
        "num_prompts": len(prompt_ids),
        "prompts_sha256": fingerprint(prompt_ids),
        "seed": seed,
        "mean_response_tokens": response_tokens / num_sequences,
        "trainable_only": trainable_only,
        "library_version": _version(),
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    return FisherAnchor(fisher, name=name, metadata=metadata)


def _labels(responses, tokenizer, num_prompts: int, estimator: str):
    if estimator == "sequence":
        if responses is not None:
            raise CFPArgumentError("responses= is only for estimator='empirical'; on-policy sampling draws its own.")
        return None
    if responses is None:
        raise CFPArgumentError("estimator='empirical' needs responses=, one per prompt.")
    labels = to_token_ids(responses, tokenizer, what="response")
    if len(labels) != num_prompts:
        raise CFPArgumentError(f"Got {len(labels)} responses for {num_prompts} prompts; give one per prompt.")
    return labels


def _eos_ids(model, tokenizer, eos_token_id) -> set[int]:
    for source in (eos_token_id, getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                   getattr(tokenizer, "eos_token_id", None)):
        if source is not None:
            return {int(t) for t in (source if isinstance(source, (list, tuple, set)) else [source])}
    return set()


@contextlib.contextmanager
def _requires_grad(params):
    """Let frozen parameters (trainable_only=False) receive scores, then restore their flags."""
    frozen = [p for p in params if not p.requires_grad]
    for p in frozen:
        p.requires_grad_(True)
    try:
        yield
    finally:
        for p in frozen:
            p.requires_grad_(False)


def _version() -> str:
    from .. import __version__

    return __version__
