"""The checks `estimate_fisher` makes before it samples: its arguments, the structure, the given responses, and
that the model is a causal LM (one forward, so a model that cannot generate fails with a clear error)."""

import torch

from ..errors import CFPArgumentError, plural
from ..geometry import STRUCTURES
from .token_ids import to_token_ids

ESTIMATORS = ("sequence", "token", "empirical")


def check_structure(structure: str, kfac_rank: int | None, estimator: str) -> None:
    """CFPArgumentError for an unknown structure, a bad kfac_rank, or K-FAC with the token estimator."""
    if structure not in STRUCTURES:
        raise CFPArgumentError(f"structure must be one of {tuple(STRUCTURES)}, got {structure!r}.")
    if kfac_rank is not None and (not isinstance(kfac_rank, int) or isinstance(kfac_rank, bool) or kfac_rank < 1):
        raise CFPArgumentError(f"kfac_rank must be None (all eigenpairs) or an integer >= 1, got {kfac_rank!r}.")
    if structure == "diagonal" and kfac_rank is not None:
        raise CFPArgumentError("kfac_rank applies to structure='kfac' only.")
    if structure == "kfac" and estimator == "token":
        raise CFPArgumentError(
            "structure='kfac' pools each sequence's positions once; the token estimator scores a prefix per token. "
            "Use estimator='sequence'."
        )


def check_arguments(estimator: str, engine: str, engines: tuple[str, ...], **counts: int) -> None:
    """CFPArgumentError for an unknown estimator or engine, or a count that is not an integer >= 1 (the seed: >= 0)."""
    if estimator not in ESTIMATORS:
        raise CFPArgumentError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}.")
    if engine not in engines:
        raise CFPArgumentError(f"engine must be one of {engines}, got {engine!r}.")
    for argument, value in counts.items():
        least = 0 if argument == "seed" else 1
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise CFPArgumentError(f"{argument} must be an integer >= {least}, got {value!r}.")


def labels_of(responses, tokenizer, num_prompts: int, estimator: str):
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
def check_causal_lm(model, prompt: list[int]) -> None:
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
