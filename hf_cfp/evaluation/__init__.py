"""Evidence about a capability that does not come from the anchor: the sequence-level KL of the
trained model to the base on the capability's prompts, and the capability's own scores on held-out
items with known answers (reference-answer log-likelihood, greedy exact match) or, for refusals, by a
phrase list on the greedy responses (refusal rate)."""

from .kl import BaseResponses, KLEstimate, draw_base_responses, kl_estimate, kl_to_base, kl_to_base_with_stderr
from .scores import (
    answer_log_probs,
    final_number,
    greedy_answers,
    greedy_exact_match,
    is_refusal,
    reference_log_likelihood,
    refusal_rate,
)

__all__ = [
    "answer_log_probs",
    "BaseResponses",
    "KLEstimate",
    "draw_base_responses",
    "final_number",
    "greedy_answers",
    "greedy_exact_match",
    "is_refusal",
    "kl_estimate",
    "kl_to_base",
    "kl_to_base_with_stderr",
    "reference_log_likelihood",
    "refusal_rate",
]
