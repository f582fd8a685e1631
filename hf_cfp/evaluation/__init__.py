"""Evidence about a capability that does not come from the anchor: the sequence-level KL of the
trained model to the base on the capability's prompts (more measurements to come)."""

from .kl import BaseResponses, KLEstimate, draw_base_responses, kl_estimate, kl_to_base, kl_to_base_with_stderr

__all__ = ["BaseResponses", "KLEstimate", "draw_base_responses", "kl_estimate", "kl_to_base", "kl_to_base_with_stderr"]
