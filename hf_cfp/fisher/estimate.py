"""estimate_fisher: the anchor Fisher of a capability at the model's current weights.

The stages, each its own piece: the arguments checked (`_check_arguments`, `Sampler`), the sampler's settings
(`sampling.SamplingSettings`), the calibration sequences and their split over processes and halves
(`calibration.CalibrationPlan`), their responses drawn or given (`_OnPolicy`, `_Given`), the groups scored
together, one sample per token for the token estimator (`calibration.ScoringGroups`), the pass that scores them
into the sinks of the structure's geometries (`feeding.ScoringPass`, `geometry.registry`), their all-reduce (the
sums on the parameters' device, the counters on `parallel.collective_device()`: a collective takes tensors of one
device), and the anchor's metadata (`_metadata`).
"""

import contextlib
from datetime import datetime, timezone

import torch
from tqdm.auto import tqdm

from ..anchor import FisherAnchor, model_fingerprint
from ..geometry.base import EstimatePlan
from ..names import named_parameters_once
from ..parallel import all_reduce_sum_, collective_device, process_rank_and_count
from ..version import __version__
from .calibration import CalibrationPlan, ScoringGroups
from .estimate_checks import check_arguments, check_causal_lm, check_structure, labels_of
from .feeding import ENGINE_FUNCTIONS, ScoringPass, scored_parameters, structure_sinks
from .sampling import Sampler, SamplingSettings
from .token_ids import prompts_sha256, to_token_ids

ENGINES = tuple(ENGINE_FUNCTIONS)


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
    structure: str = "diagonal",
    kfac_rank: int | None = None,
) -> FisherAnchor:
    """Estimate the output Fisher of `model` on a capability's prompts: its diagonal, or (structure="kfac")
    Kronecker factors for its Linear-like weights.

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

    structure="kfac": on the same sequences, for every Linear-like weight W (out x in: nn.Linear and GPT-2 Conv1D
    with their stock forward, owned by that module alone, whatever their width; `geometry.kronecker.factors`), with
    positions t running over every token fed to the scoring forward (prompt and response, T in all), a_t the
    layer's input and g_t = d log mu(y_n | x_n) / d(layer output at t):

        A = (1/T) sum_{n,t} a a^T,   G = (1/N) sum_{n,t} g g^T,   F_W ~ A (x) G,

    kept as their eigenbases (top `kfac_rank` eigenpairs of each and the mean of the rest as a tail; all by
    default). A factor wider than `geometry.kronecker.factors.MAX_FORMED_DIMENSION` (an untied vocabulary-sized
    lm_head's G) is never formed: its top eigenpairs come from a streamed sketch refined by a second pass over the
    scored sequences, keeping `kfac_rank` of them (`factors.WIDE_RANK` when None). Every other covered parameter
    (embeddings, norms, biases, a weight tied to an embedding) keeps its diagonal F above, and the split-half
    statistics cover that diagonal part. Sequence and empirical estimators only.

    Args:
        model: a causal LM (`model(input_ids).logits`; on-policy sampling runs its `generate`); returned in its
            original train/eval mode, with no `.grad` written.
        tokenizer: needed for text or chat prompts; may be None for token-id prompts.
        prompts: strings (chat models get their chat template), chat message lists, token-id
            lists, or a `datasets.Dataset` with a `prompt` column.
        num_sequences: N, calibration sequences (the paper uses 128); prompts are cycled.
        max_new_tokens: longest response.
        batch_size: sequences sampled together (left-padded, KV cache).
        seed: the same seed, batch_size and scoring_tokens give the same anchor bit for bit (on one
            process and one kind of device: a CPU and a GPU draw different sequences).
        temperature, top_k, top_p: the sampler (explicit; the model's generation config is ignored, and one that
            sets a setting generate would add to the sampler, such as `suppress_tokens` or `min_p`, is refused).
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
            sampling batch does not set it. `calibration.scoring_groups` states the rule.
        structure: "diagonal" (default) or "kfac" (see above).
        kfac_rank: with structure="kfac", the eigenpairs kept per factor (None: all); the correction then pulls on
            the top block alone.

    Returns:
        [`FisherAnchor`]: F by canonical parameter name (float32, CPU), named `name`, with its metadata: the
        sampler, seed, counts, mean response length (the Fisher's scale), prompt hash, base fingerprint and
        split-half statistics.

    Raises:
        CFPArgumentError: an unknown estimator, engine or structure, a non-positive count or negative seed, a bad
            sampler setting, no prompts, text prompts without a tokenizer, `responses` that do not fit the
            estimator, or K-FAC with the token estimator.
    """
    check_structure(structure, kfac_rank, estimator)
    check_arguments(
        estimator,
        engine,
        ENGINES,
        num_sequences=num_sequences,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        seed=seed,
        num_samples_per_prompt=num_samples_per_prompt,
        scoring_tokens=scoring_tokens,
    )
    sampler = Sampler() if estimator == "empirical" else Sampler(temperature, top_k, top_p)
    prompt_ids = to_token_ids(prompts, tokenizer)
    labels = labels_of(responses, tokenizer, len(prompt_ids), estimator)
    settings = SamplingSettings.resolve(model, tokenizer, sampler, max_new_tokens, eos_token_id, seed)
    plan = CalibrationPlan(num_sequences, batch_size, num_samples_per_prompt, *process_rank_and_count())
    named = named_parameters_once(model, trainable_only=trainable_only)
    disable = not show_progress or plan.rank != 0
    parts = EstimatePlan(num_sequences, plan.half, kfac_rank, name, show_progress=not disable)
    sinks = structure_sinks(structure, scored_parameters(model, list(named)), parts)
    sums = ScoringPass(sinks, engine, settings.sampler, settings.pad_id)
    groups = ScoringGroups(estimator == "token", batch_size, scoring_tokens)
    with _evaluating(model):
        check_causal_lm(model, prompt_ids[0])
        with (
            requiring_grad(sums.params),
            _progress_bar(name, plan.sequences, labels is None, max_new_tokens, disable) as bar,
        ):
            source = _OnPolicy(settings, bar) if labels is None else _Given(labels, plan, bar)
            response_tokens = _score_batches(model, prompt_ids, plan, source, groups, sums)
            all_reduce_sum_(sums.reduced())  # beside the parameters
            all_reduce_sum_([response_tokens, *sums.counts()])  # on collective_device()
            all_reduce_sum_(sums.refine(model))  # factors too wide to form: a second pass over their sketches
    finished = sums.finish()
    metadata = _metadata(
        model,
        estimator,
        settings,
        plan,
        prompt_ids,
        sampled=labels is None,
        mean_response_tokens=float(response_tokens) / num_sequences,
        split_half=next((p.split_half for p in finished if p.split_half is not None), None),
        trainable_only=trainable_only,
    )
    fisher, bases = {}, {}
    for part in finished:
        fisher.update(part.fisher)
        bases.update(part.kfac)
        metadata.update(part.metadata)
    return FisherAnchor(fisher, name=name, metadata=metadata, kfac=bases)


def _score_batches(model, prompt_ids, plan: CalibrationPlan, source, groups: ScoringGroups, sums: ScoringPass):
    """Every batch of this process: its prompts, their responses (`source`), each half's groups added to `sums`.
    Returns the number of response tokens, float64 [1] on `collective_device()` (to be all-reduced)."""
    response_tokens = torch.zeros(1, dtype=torch.float64, device=collective_device())
    for k in plan.batches:
        indices = plan.indices(k)
        batch = plan.cycled(prompt_ids, indices)
        drawn, supports = source.responses(model, batch, k, indices)
        for first_half, part in plan.halves(indices):
            for group in groups(batch[part], drawn[part], supports[part]):
                sums.add(model, *group, first_half=first_half)
        response_tokens += sum(len(r) for r in drawn)
        source.scored(len(indices))
    return response_tokens


class _OnPolicy:
    """Responses drawn from the model (`SamplingSettings.draw`), the bar moving with every generation step."""

    def __init__(self, settings: SamplingSettings, bar: tqdm):
        self.settings, self.bar = settings, bar

    def responses(self, model, prompts: list[list[int]], k: int, indices: range):
        self.bar.set_postfix_str("sampling")
        drawn, supports = self.settings.draw(model, prompts, k, self.bar.update)
        self.bar.update(len(indices) * self.settings.max_new_tokens - sum(len(r) for r in drawn))  # ended at EOS
        self.bar.set_postfix_str("scoring")
        return drawn, supports

    def scored(self, count: int) -> None:
        """Nothing: the bar counts tokens as they are drawn."""


class _Given:
    """The given responses (labels) of the empirical estimator, cycled like the prompts; the bar counts sequences."""

    def __init__(self, labels: list[list[int]], plan: CalibrationPlan, bar: tqdm):
        self.labels, self.plan, self.bar = labels, plan, bar

    def responses(self, model, prompts: list[list[int]], k: int, indices: range):
        drawn = self.plan.cycled(self.labels, indices)
        return drawn, [None] * len(drawn)

    def scored(self, count: int) -> None:
        self.bar.update(count)


def _metadata(
    model,
    estimator: str,
    settings: SamplingSettings,
    plan: CalibrationPlan,
    prompt_ids: list[list[int]],
    *,
    sampled: bool,
    mean_response_tokens: float,
    split_half: dict | None,
    trainable_only: bool,
) -> dict:
    """The anchor's metadata: the base model, how the sequences were drawn (the sampler only when `sampled`, not for
    given responses) and scored, and what they came out as."""
    return {
        "base_model": getattr(model.config, "_name_or_path", None) or None,
        "base_model_revision": getattr(model.config, "_commit_hash", None),
        "base_fingerprint": model_fingerprint(model),
        "estimator": estimator,
        "sampler": settings.as_dict() if sampled else None,
        "num_samples_per_prompt": plan.num_samples_per_prompt,
        "num_processes": plan.count,
        "num_sequences": plan.num_sequences,
        "num_prompts": len(prompt_ids),
        "prompts_sha256": prompts_sha256(prompt_ids),
        "seed": settings.seed,
        "mean_response_tokens": mean_response_tokens,
        "split_half": split_half,
        "trainable_only": trainable_only,
        "library_version": __version__,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


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


@contextlib.contextmanager
def _evaluating(model):
    """The model in eval mode (no dropout: every sequence scored as drawn), then back in its own mode."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


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
