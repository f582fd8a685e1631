"""Per-sequence scores and the running sum of their squares (the plain, exact loop engine)."""

import torch

from .sampling import Sampler


def sequence_log_prob(model, prompt: list[int], response: list[int], sampler: Sampler) -> torch.Tensor:
    """log mu(y|x) = sum_t log mu(y_t | x, y_<t), response tokens only (the prompt is context)."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + response], device=device)
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    targets = torch.tensor(response, device=device).unsqueeze(1)
    return sampler.log_probs(logits).gather(1, targets).sum()


def add_squared_score(accumulators: list[torch.Tensor], params: list[torch.Tensor], log_prob: torch.Tensor) -> None:
    """accumulators += (d log_prob / d theta)^2, elementwise; no `.grad` is written."""
    grads = torch.autograd.grad(log_prob, params, allow_unused=True)
    used = [i for i, g in enumerate(grads) if g is not None]
    used_grads = [grads[i].float() for i in used]
    torch._foreach_addcmul_([accumulators[i] for i in used], used_grads, used_grads)
