"""Per-sequence log-probabilities and scores: the plain one-sequence form, the right-padded batch
both engines and the capability KL score with, and the running sum of squared scores.

The Fisher scores (`sequence_log_prob`, `PaddedBatch.response_log_prob`) take the support of mu
each response token was drawn from (`sampling.sample_with_supports`; None: recompute it from the
scoring logits) and raise `CFPArgumentError` for a response token of probability 0 under mu,
whose score would be finite and wrong (see `sampling`'s docstring)."""

import torch

from ..errors import CFPArgumentError
from .sampling import Sampler, unpack_support


def sequence_log_prob(
    model, prompt: list[int], response: list[int], sampler: Sampler, support: torch.Tensor | None = None
) -> torch.Tensor:
    """log mu(y|x) = sum_t log mu(y_t | x, y_<t), response tokens only (the prompt is context).
    support: the packed support of each response token (rows of `sample_with_supports`), or None."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + response], device=device)
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    targets = torch.tensor(response, device=device).unsqueeze(1)
    packed = _packed_supports(None if support is None else [support], [response], device)
    mask = None if packed is None else unpack_support(packed, logits.shape[-1])
    per_token = sampler.log_probs(logits, mask).gather(1, targets).squeeze(1)
    _check_drawable(per_token, [response], sampler)
    return per_token.sum()


class PaddedBatch:
    """Right-padded prompt+response ids. Right padding keeps every real token's causal context
    free of padding, so no attention row is fully masked and padding cannot leak into a score."""

    def __init__(self, prompts, responses, pad_id, device, supports=None):
        self.size = len(prompts)
        self.responses = responses
        self.support = _packed_supports(supports, responses, device)  # packed, one row per response token
        seqs = [list(p) + list(r) for p, r in zip(prompts, responses, strict=True)]
        width = max(len(s) for s in seqs)
        rows: list[int] = []
        cols: list[int] = []
        targets: list[int] = []
        for b, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
            rows += [b] * len(response)  # position t predicts token t + 1
            cols += range(len(prompt) - 1, len(prompt) + len(response) - 1)
            targets += response
        self.ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in seqs], device=device)
        self.mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs], device=device)
        self.positions = (self.mask.cumsum(-1) - 1).clamp(min=0)
        self.rows, self.cols = torch.tensor(rows, device=device), torch.tensor(cols, device=device)
        self.targets = torch.tensor(targets, dtype=torch.long, device=device)

    def token_log_probs(self, logits: torch.Tensor, sampler: Sampler) -> torch.Tensor:
        """log mu(y_{b,t} | prefix) for every response token, flattened in (b, t) order."""
        picked = logits[self.rows, self.cols]
        mask = None if self.support is None else unpack_support(self.support, picked.shape[-1])
        return sampler.log_probs(picked, mask).gather(1, self.targets.unsqueeze(1)).squeeze(1)

    def response_log_prob(self, logits: torch.Tensor, sampler: Sampler) -> torch.Tensor:
        """sum_b sum_{t in response_b} log mu(y_{b,t} | prefix): padding and prompts masked out.
        Raises CFPArgumentError if a response token has probability 0 under mu."""
        per_token = self.token_log_probs(logits, sampler)
        _check_drawable(per_token, self.responses, sampler)
        return per_token.sum()

    def sequence_log_probs(self, logits: torch.Tensor, sampler: Sampler) -> torch.Tensor:
        """[log mu(y_b | x_b) for b in batch], float64 sums of the response tokens' float32 log-probs."""
        per_token = self.token_log_probs(logits, sampler).double()
        return torch.zeros(self.size, dtype=torch.float64, device=per_token.device).index_add_(0, self.rows, per_token)


@torch.no_grad()
def batched_sequence_log_probs(
    model, prompts: list[list[int]], responses: list[list[int]], sampler: Sampler, pad_id: int = 0
) -> torch.Tensor:
    """log mu(y_b | x_b) = sum_t log mu(y_b,t | x_b, y_b,<t) for every sequence b, in one forward of the
    right-padded batch (response tokens only; an empty response has log-prob 0). Float64, on CPU.
    The model's train/eval mode is left as it is (call ``model.eval()`` for dropout-free scores)."""
    device = next(model.parameters()).device
    batch = PaddedBatch(prompts, responses, pad_id, device)
    out = model(input_ids=batch.ids, attention_mask=batch.mask, position_ids=batch.positions, use_cache=False)
    return batch.sequence_log_probs(out.logits, sampler).cpu()


def add_squared_score(accumulators: list[torch.Tensor], params: list[torch.Tensor], log_prob: torch.Tensor) -> None:
    """accumulators += (d log_prob / d theta)^2, elementwise; no `.grad` is written."""
    grads = torch.autograd.grad(log_prob, params, allow_unused=True)
    used = [i for i, g in enumerate(grads) if g is not None]
    used_grads = [grads[i].float() for i in used]
    torch._foreach_addcmul_([accumulators[i] for i in used], used_grads, used_grads)


def _packed_supports(supports, responses, device) -> torch.Tensor | None:
    """The packed supports of all response tokens, in (b, t) order, on `device`; None if none given."""
    if supports is None or all(support is None for support in supports):
        return None
    if len(supports) != len(responses) or any(
        s is None or len(s) != len(r) for s, r in zip(supports, responses, strict=True)
    ):
        raise CFPArgumentError(
            "supports must hold, for every response, one packed support row per response token "
            "(as sample_with_supports returns them), or be None."
        )
    return torch.cat(list(supports)).to(device)


def _check_drawable(per_token: torch.Tensor, responses, sampler: Sampler) -> None:
    """Raise if a response token has log mu = -inf: it cannot have been drawn from mu, and its score
    d log mu / d theta would come out finite and wrong."""
    bad = torch.isneginf(per_token.detach())
    if not bool(bad.any()):
        return
    b, index = 0, int(bad.nonzero()[0])  # flattened (b, t) -> b, t
    while index >= len(responses[b]):
        index, b = index - len(responses[b]), b + 1
    raise CFPArgumentError(
        f"Sequence {b} of the batch, response position {index} (token {responses[b][index]}): probability 0 "
        f"under the sampler {sampler.as_dict()}, so it was not drawn from it and its score would be wrong. "
        "Top-k / top-p supports recomputed at scoring time can drop a drawn token at the boundary: score "
        "sampled responses with the supports they were drawn from (supports= from sample_with_supports, "
        "as estimate_fisher does), and score other responses with a sampler without top_k / top_p."
    )
