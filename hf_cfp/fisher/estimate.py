"""estimate_fisher: the anchor Fisher of a capability at the model's current weights."""

import contextlib
import math
from collections.abc import Callable
from datetime import datetime, timezone

import torch
from tqdm.auto import tqdm

from ..anchor import FisherAnchor, model_fingerprint
from ..anchor.compare import split_half
from ..errors import CFPArgumentError, plural
from ..names import named_parameters_once
from ..parallel import all_reduce_sum_, process_rank_and_count
from ..version import __version__
from .batched import add_batched_squared_scores
from .prompts import prompts_sha256, to_token_ids
from .sampling import Sampler, batch_generator, resolve_eos_ids, resolve_pad_id, sample_with_supports
from .scoring import add_squared_score, sequence_log_prob

ESTIMATORS = ("sequence", "token", "empirical")
ENGINES = ("batched", "loop")


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
    engine: str = "batched",
    num_samples_per_prompt: int = 1,
    responses=None,
    trainable_only: bool = True,
    eos_token_id: int | list[int] | None = None,
    show_progress: bool = True,
    scoring_tokens: int = 256,
) -> FisherAnchor:
    """Estimate the diagonal output Fisher of `model` on a capability's prompts.

    estimator="sequence" (default, on-policy, the paper's definition): for n = 1..N,
    x_n = prompts[(n // num_samples_per_prompt) % len(prompts)], y_n ~ mu(.|x_n) drawn from the
    model itself, and

        F_i = (1/N) sum_n ( d/dtheta_i log mu(y_n | x_n) )^2,

    the mean of per-sequence squared scores over response tokens only (the prompt is context,
    the response ends at its first EOS). mu is the sampler's own distribution: softmax(z/T),
    truncated to top-k / top-p and renormalized, so the score is centered under the sampler
    (mu = pi at temperature 1 without truncation). Each token is scored on the support it was
    drawn from, with the scoring forward's logits (`sampling`'s docstring says why).

    estimator="token": F_i = (1/N) sum_n sum_t ( d/dtheta_i log mu(y_n,t | x_n, y_n,<t) )^2 on
    the same samples. Cross-position terms vanish in expectation on-policy, so it has the same
    expectation as "sequence", at about T times the cost (one scored sample per token).

    estimator="empirical" scores the given `responses` (labels) instead of samples: the
    *empirical* Fisher, a different quantity that is not centered under the model.

    engine="batched" (default) scores a batch in one forward and backward with per-sequence
    gradients formed layer by layer in backward hooks (exact); engine="loop" is the plain
    per-sequence reference. Under `accelerate launch` / torchrun, batches are split across
    processes (batch k on process k % count) and the sums are added across processes: every
    batch draws from its own seeded stream, so the anchor is the single-process anchor.

    Split-half reliability, `metadata["split_half"]` (None when N < 2): the squared scores of
    sequences n < N/2 (in the order above) and n >= N/2 are summed apart, S_a and S_b, so that
    F = (S_a + S_b) / N, F_a = S_a / N_a and F_b = S_b / N_b, at the cost of one more float32
    accumulator; recorded are {"top1pct_overlap": |T1(F_a) ∩ T1(F_b)| / |T1|, T1 the top ceil(0.01 n)
    coordinates (ties to the lower index), "mass_relative_difference": |M_a - M_b| / ((M_a + M_b) / 2),
    M = sum_i F_i, "num_sequences": [N_a, N_b]}. Every estimator and engine provides it (the token
    estimator splits by the sequence its tokens come from). It sits beside `metadata["statistics"]`,
    which the anchor recomputes from its tensors alone.

    Args:
        model: a causal LM (`model(input_ids).logits`); returned in its original train/eval mode,
            with no `.grad` written.
        tokenizer: needed for text or chat prompts; may be None for token-id prompts.
        prompts: strings (chat models get their chat template), chat message lists, token-id
            lists, or a `datasets.Dataset` with a `prompt` column.
        num_sequences: N, calibration sequences (the paper uses 128); prompts are cycled.
        max_new_tokens: longest response.
        batch_size: sequences sampled together (left-padded, KV cache).
        seed: the same seed, batch_size and scoring_tokens give the same anchor bit for bit (on one
            process).
        temperature, top_k, top_p: the sampler (explicit; the model's generation config is ignored).
        name: the capability name, used in metric keys.
        estimator: "sequence", "token" or "empirical" (see above).
        engine: "batched" or "loop".
        num_samples_per_prompt: responses drawn per prompt before moving to the next prompt.
        responses: for estimator="empirical", one response (text or token ids) per prompt.
        trainable_only: cover only parameters with requires_grad (default).
        eos_token_id: ends a response; default the model's generation config, then the tokenizer's.
        show_progress: a tqdm bar on the first process, with rate and ETA: response tokens against the
            budget num_sequences x max_new_tokens, moving at every generation step (sequences for "empirical").
        scoring_tokens: consecutive sequences of a sampled batch are scored in one forward and backward
            while (sequences x padded length) <= scoring_tokens (at least one sequence): the scoring
            memory grows with these tokens (about 2.6 MB each for a 135M model in float32), so the
            sampling batch does not set it. `_scoring_groups` states the rule.

    Returns:
        [`FisherAnchor`]: F by canonical parameter name (float32, CPU), named `name`, with its metadata: the
        sampler, seed, counts, mean response length (the Fisher's scale), prompt hash, base fingerprint and
        split-half statistics.

    Raises:
        CFPArgumentError: an unknown estimator or engine, a non-positive count or negative seed, a bad sampler
            setting, no prompts, text prompts without a tokenizer, or `responses` that do not fit the estimator.
    """
    if estimator not in ESTIMATORS:
        raise CFPArgumentError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}.")
    if engine not in ENGINES:
        raise CFPArgumentError(f"engine must be one of {ENGINES}, got {engine!r}.")
    for argument, value, least in (
        ("num_sequences", num_sequences, 1),
        ("max_new_tokens", max_new_tokens, 1),
        ("batch_size", batch_size, 1),
        ("seed", seed, 0),
        ("num_samples_per_prompt", num_samples_per_prompt, 1),
        ("scoring_tokens", scoring_tokens, 1),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise CFPArgumentError(f"{argument} must be an integer >= {least}, got {value!r}.")
    sampler = Sampler() if estimator == "empirical" else Sampler(temperature, top_k, top_p)
    prompt_ids = to_token_ids(prompts, tokenizer)
    labels = _labels(responses, tokenizer, len(prompt_ids), estimator)
    eos_ids = resolve_eos_ids(model, tokenizer, eos_token_id)
    pad_id = resolve_pad_id(tokenizer, eos_ids)
    score = _ENGINE_FUNCTIONS[engine]

    named = list(named_parameters_once(model, trainable_only=trainable_only))
    params = [p for _, p in named]
    sums = [torch.zeros_like(p, dtype=torch.float32) for p in params]  # S_b, then S = S_a + S_b
    half = math.ceil(num_sequences / 2) if num_sequences >= 2 else 0  # sequences n < N/2 form the first half
    first = [torch.zeros_like(s) for s in sums] if half else []  # S_a: the one extra accumulator
    rank, count = process_rank_and_count()
    my_batches = range(rank, math.ceil(num_sequences / batch_size), count)
    my_sequences = sum(min(batch_size, num_sequences - k * batch_size) for k in my_batches)
    response_tokens = torch.zeros(1, dtype=torch.float64)
    was_training = model.training
    model.eval()
    try:
        _check_causal_lm(model, prompt_ids[0])
        with (
            requiring_grad(params),
            _progress_bar(
                name, my_sequences, labels is None, max_new_tokens, not show_progress or rank != 0
            ) as progress,
        ):
            for k in my_batches:
                indices = range(k * batch_size, min((k + 1) * batch_size, num_sequences))
                batch = [prompt_ids[(n // num_samples_per_prompt) % len(prompt_ids)] for n in indices]
                if labels is None:
                    progress.set_postfix_str("sampling")
                    drawn, supports = sample_with_supports(
                        model,
                        batch,
                        sampler,
                        max_new_tokens,
                        eos_ids,
                        pad_id,
                        batch_generator(seed, k),
                        progress.update,
                    )
                    progress.update(len(indices) * max_new_tokens - sum(len(r) for r in drawn))  # ended at EOS
                    progress.set_postfix_str("scoring")
                else:
                    drawn = [labels[(n // num_samples_per_prompt) % len(labels)] for n in indices]
                    supports = [None] * len(drawn)
                cut = min(max(half - indices.start, 0), len(indices))  # batch[:cut] is in the first half
                for accumulators, part in ((first, slice(0, cut)), (sums, slice(cut, None))):
                    part_prompts, part_responses, part_supports = batch[part], drawn[part], supports[part]
                    if estimator == "token":
                        part_prompts, part_responses, part_supports = _one_token_samples(
                            part_prompts, part_responses, part_supports
                        )
                    for group in _scoring_groups(part_prompts, part_responses, batch_size, scoring_tokens):
                        score(
                            model,
                            params,
                            accumulators,
                            part_prompts[group],
                            part_responses[group],
                            sampler,
                            pad_id,
                            supports=part_supports[group],
                        )
                response_tokens += sum(len(r) for r in drawn)
                if labels is not None:
                    progress.update(len(indices))
    finally:
        model.train(was_training)
    all_reduce_sum_([*sums, *first, response_tokens])

    reliability = split_half(first, sums, half, num_sequences - half) if half else None
    if half:
        torch._foreach_add_(sums, first)
    del first  # before the anchor is built: its statistics need memory of their own
    fisher = {n: s.div_(num_sequences).cpu() for (n, _), s in zip(named, sums, strict=True)}
    metadata = {
        "base_model": getattr(model.config, "_name_or_path", None) or None,
        "base_model_revision": getattr(model.config, "_commit_hash", None),
        "base_fingerprint": model_fingerprint(model),
        "estimator": estimator,
        "sampler": {**sampler.as_dict(), "max_new_tokens": max_new_tokens} if labels is None else None,
        "num_samples_per_prompt": num_samples_per_prompt,
        "num_processes": count,
        "num_sequences": num_sequences,
        "num_prompts": len(prompt_ids),
        "prompts_sha256": prompts_sha256(prompt_ids),
        "seed": seed,
        "mean_response_tokens": float(response_tokens) / num_sequences,
        "split_half": reliability,
        "trainable_only": trainable_only,
        "library_version": __version__,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    return FisherAnchor(fisher, name=name, metadata=metadata)


def _progress_bar(name: str, sequences: int, sampling: bool, max_new_tokens: int, disable: bool) -> tqdm:
    """The estimate's bar (tqdm: count, rate, ETA). Sampling, it counts response tokens against the budget
    `sequences x max_new_tokens` and moves at every generation step; a batch's responses that end at EOS
    add their unused budget when sampling ends, and its postfix then says "scoring". Scoring given
    responses (the empirical estimator), it counts sequences."""
    if sampling:
        return tqdm(
            total=sequences * max_new_tokens, desc=f"Fisher[{name}]", unit="tok", unit_scale=True, disable=disable
        )
    return tqdm(total=sequences, desc=f"Fisher[{name}]", unit="seq", disable=disable)


def _loop_engine(model, params, sums, prompts, responses, sampler, pad_id, supports) -> None:
    """The plain reference: one forward and backward per sequence, each token scored on its support."""
    for prompt, response, support in zip(prompts, responses, supports, strict=True):
        add_squared_score(sums, params, sequence_log_prob(model, prompt, response, sampler, support))


_ENGINE_FUNCTIONS: dict[str, Callable[..., None]] = {"batched": add_batched_squared_scores, "loop": _loop_engine}


def _scoring_groups(prompts, responses, batch_size: int, scoring_tokens: int) -> list[slice]:
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


def _one_token_samples(prompts, responses, supports):
    """The token estimator's samples: (x + y_<t, [y_t]) for every response position t, so that
    sum over samples of squared scores = sum_n sum_t (d log mu(y_t | x, y_<t))^2; each keeps the
    support y_t was drawn from (row t of its response's supports, or None)."""
    samples = [
        (p + r[:t], [r[t]], None if s is None else s[t : t + 1])
        for p, r, s in zip(prompts, responses, supports, strict=True)
        for t in range(len(r))
    ]
    return [p for p, _, _ in samples], [r for _, r, _ in samples], [s for _, _, s in samples]


def _labels(responses, tokenizer, num_prompts: int, estimator: str):
    if estimator != "empirical":
        if responses is not None:
            raise CFPArgumentError("responses= is only for estimator='empirical'; on-policy sampling draws its own.")
        return None
    if responses is None:
        raise CFPArgumentError("estimator='empirical' needs responses=, one per prompt.")
    labels = to_token_ids(responses, tokenizer, what="response")
    if len(labels) != num_prompts:
        raise CFPArgumentError(
            f"Got {plural(len(labels), 'response')} for {plural(num_prompts, 'prompt')}; give one per prompt."
        )
    return labels


_NOT_A_CAUSAL_LM = (
    "estimate_fisher needs a causal language model: model(input_ids=..., attention_mask=...) must "
    "return an output with .logits of shape (batch, sequence, vocab), e.g. an AutoModelForCausalLM; "
)


@torch.no_grad()
def _check_causal_lm(model, prompt: list[int]) -> None:
    """One forward on one prompt, so a model that cannot generate fails here with a clear error
    rather than deep inside sampling or scoring. It draws no random numbers (the model is in
    eval mode), so the anchor is unchanged."""
    try:
        device = next(model.parameters()).device
    except StopIteration:
        raise CFPArgumentError(_NOT_A_CAUSAL_LM + f"{type(model).__name__} has no parameters.") from None
    ids = torch.tensor([prompt], device=device)
    try:
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids))
    except Exception as error:
        raise CFPArgumentError(
            _NOT_A_CAUSAL_LM + f"calling {type(model).__name__} failed with {type(error).__name__}: {error}"
        ) from error
    logits = getattr(out, "logits", None)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(ids.shape):
        got = f"logits of shape {tuple(logits.shape)}" if isinstance(logits, torch.Tensor) else f"{type(out).__name__}"
        raise CFPArgumentError(_NOT_A_CAUSAL_LM + f"{type(model).__name__} returned {got}.")


@contextlib.contextmanager
def requiring_grad(params):
    """Let frozen parameters (trainable_only=False) receive scores, then restore their flags."""
    frozen = [p for p in params if not p.requires_grad]
    for p in frozen:
        p.requires_grad_(True)
    try:
        yield
    finally:
        for p in frozen:
            p.requires_grad_(False)
