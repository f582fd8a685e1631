"""The seeds' own diagnostics of an anchor against a real training gradient: where the gradient lies
(its energy in the anchor's top-1% set) and how the Fisher bound |g_i| <= sqrt(F_i) sqrt(E[a^2]) holds.

The gradient is that of a causal-LM (SFT) batch, token ids and labels (-100 = not scored):

    g_i = (1/B) sum_b d/dtheta_i log pi(y_b | x_b),

y_b the labelled tokens of row b and x_b what precedes them, the mean over rows of the sequence
log-likelihood (a Trainer's mean-per-token loss has the same direction, scaled by -B / tokens).
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..anchor import FisherAnchor
from ..anchor.compare import layout_difference
from ..errors import AnchorMismatchError, CFPArgumentError, plural
from ..names import named_parameters_once
from ..ops.order_statistics import top_mask, top_overlap
from .estimate import requiring_grad

IGNORE_INDEX = -100  # the label of positions the loss skips (transformers' convention)


def labelled_gradient(model, params, input_ids, labels, attention_mask=None, batch_size: int = 8):
    """(g, log_probs, tokens): g the float32 tensors (1/B) sum_b d/dtheta log pi(y_b | x_b) for `params`,
    log_probs the float64 [B] of log pi(y_b | x_b) = sum_{t: labels[b, t] != -100} log softmax(z_{b, t-1})
    [labels[b, t]] (transformers' shift: logits at t - 1 predict the label at t), tokens the labelled count.

    Rows go through the model `batch_size` at a time (memory only: the result does not depend on it), in
    eval mode (restored after), at temperature 1; no `.grad` is written."""
    if input_ids.shape != labels.shape or input_ids.dim() != 2:
        raise CFPArgumentError(
            f"input_ids {tuple(input_ids.shape)} and labels {tuple(labels.shape)}: give (B, T) both."
        )
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise CFPArgumentError(f"batch_size must be an integer >= 1, got {batch_size!r}.")
    if not (labels[:, 1:] != IGNORE_INDEX).any():
        raise CFPArgumentError("No labelled token (labels != -100 after the first position): nothing to diagnose.")
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    device = params[0].device
    sums = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    log_probs = []
    was_training = model.training
    model.eval()
    try:
        with requiring_grad(params):
            for start in range(0, len(input_ids), batch_size):
                ids, lab, att = (t[start : start + batch_size].to(device) for t in (input_ids, labels, mask))
                positions = (att.cumsum(-1) - 1).clamp(min=0)  # right or left padding
                logits = model(input_ids=ids, attention_mask=att, position_ids=positions, use_cache=False).logits
                targets = lab[:, 1:]
                rows, cols = (targets != IGNORE_INDEX).nonzero(as_tuple=True)
                token = (
                    logits[:, :-1][rows, cols]
                    .float()
                    .log_softmax(-1)
                    .gather(1, targets[rows, cols].unsqueeze(1))[:, 0]
                )
                grads = torch.autograd.grad(token.sum(), params, allow_unused=True)
                used = [i for i, grad in enumerate(grads) if grad is not None]
                torch._foreach_add_([sums[i] for i in used], [grads[i].float() for i in used])
                per_row = torch.zeros(len(ids), dtype=torch.float64, device=device)
                log_probs.append(per_row.index_add_(0, rows, token.detach().double()).cpu())
    finally:
        model.train(was_training)
    torch._foreach_div_(sums, len(input_ids))
    return sums, torch.cat(log_probs), int((labels[:, 1:] != IGNORE_INDEX).sum())


def sft_signal_log_second_moment(log_probs: torch.Tensor) -> float:
    """log E[a^2] of SFT's signal a = w - 1, w = D(y|x) / pi(y|x) (fisher-bounds-for-likely-updates),
    with each row's labelled response taken as the data's only response to its prompt (D(y_b|x_b) = 1):
    E_pi[a^2 | x_b] = chi^2(D || pi) = 1 / pi(y_b|x_b) - 1, so

        E[a^2] = (1/B) sum_b (1 / pi(y_b|x_b) - 1),

    computed in log space (1 / pi overflows float64 past 709 nats): m = logsumexp(-log pi) - log B,
    log E[a^2] = m + log(1 - e^-m); -inf when every label has probability 1."""
    m = float(torch.logsumexp(-log_probs.double(), 0)) - math.log(len(log_probs))
    return m + math.log1p(-math.exp(-m)) if m > 0 else -math.inf


def gradient_concentration(gradient: Sequence[torch.Tensor], fisher: Sequence[torch.Tensor], fraction=0.01):
    """Where the gradient's energy lies, with T(v) the top ceil(fraction * n) coordinates of v (`top_mask`):

    - `energy_share` = sum_{i in T(F)} g_i^2 / sum_i g_i^2 (`fraction` at random; nan if g = 0),
    - `top_overlap` = |T(F) ∩ T(|g|)| / |T| (`top_overlap`; the sparse seed reports 0.474 for 1%)."""
    mask, offset, top, total = top_mask(fisher, fraction), 0, 0.0, 0.0
    for g in gradient:
        energy = g.detach().reshape(-1).double().square()
        top += float(energy[mask[offset : offset + energy.numel()].to(energy.device)].sum())
        total, offset = total + float(energy.sum()), offset + energy.numel()
    return {
        "fraction": fraction,
        "energy_share": top / total if total > 0 else math.nan,
        "top_overlap": top_overlap(fisher, [g.detach().abs() for g in gradient], fraction),
    }


def fisher_bound(gradient: Sequence[torch.Tensor], fisher: Sequence[torch.Tensor], log_second_moment: float):
    """The bound |g_i| <= sqrt(F_i) sqrt(E[a^2]) checked coordinate by coordinate, through the ratios

        r_i = |g_i| / (sqrt(F_i) sqrt(E[a^2]))    (r_i = 0 where g_i = 0; +inf where F_i = 0 < |g_i|),

    computed in log10 (sqrt(E[a^2]) may pass float64's range). Returns `log10_signal_scale` =
    log10 sqrt(E[a^2]), `holds_share` = #{r_i <= 1} / n, `unbounded` = #{F_i = 0 < |g_i|},
    `ratio_median` (the lower median, as torch.median), `ratio_max`, `above_half_share` = #{r_i > 0.5} / n,
    and `log10_required_scale` = log10 max_{F_i > 0} |g_i| / sqrt(F_i), the smallest sqrt(E[a^2]) with
    which the bound would hold on every coordinate of nonzero F."""
    log10_scale = 0.5 * log_second_moment / math.log(10)
    count = holds = above = unbounded = 0
    required, pieces = -math.inf, []
    for g, f in zip(gradient, fisher, strict=True):
        g, f = g.detach().float().abs().cpu(), f.detach().float().cpu()
        log_ratio = g.log10() - 0.5 * f.log10()  # log10 |g_i| / sqrt(F_i), in float32 (135M coordinates)
        required = max(required, float(log_ratio.masked_fill(f == 0, -math.inf).max()))
        log_ratio = log_ratio.sub_(log10_scale).masked_fill_(g == 0, -math.inf)
        count, unbounded = count + g.numel(), unbounded + int(((f == 0) & (g > 0)).sum())
        holds, above = holds + int((log_ratio <= 0).sum()), above + int((log_ratio > math.log10(0.5)).sum())
        pieces.append(log_ratio.reshape(-1))
    flat = torch.cat(pieces)
    median, largest = flat.kthvalue((count + 1) // 2).values, flat.max()
    return {
        "log10_signal_scale": log10_scale,
        "holds_share": holds / count,
        "unbounded": unbounded,
        "ratio_median": float(10 ** median.double()),
        "ratio_max": float(10 ** largest.double()),
        "above_half_share": above / count,
        "log10_required_scale": required,
    }


@dataclass(frozen=True)
class GradientDiagnostics:
    """`diagnose`'s report: the batch, `gradient_concentration`'s and `fisher_bound`'s numbers."""

    anchor: str
    num_coordinates: int
    num_sequences: int
    num_tokens: int
    fraction: float
    fisher_mass_share: float  # sum_{i in T(F)} F_i / sum_i F_i (the anchor's statistics), beside energy_share
    energy_share: float
    top_overlap: float
    log10_signal_scale: float
    holds_share: float
    unbounded: int
    ratio_median: float
    ratio_max: float
    above_half_share: float
    log10_required_scale: float

    def to_text(self) -> str:
        pct = f"{self.fraction:.0%}" if self.fraction >= 0.01 else f"{self.fraction:.1%}"
        rows = [
            ("sum_{T(F)} F_i / sum F_i", f"{self.fisher_mass_share:.4f}"),
            ("sum_{T(F)} g_i^2 / sum g_i^2", f"{self.energy_share:.4f}   (random {self.fraction:.4f})"),
            ("|T(F) & T(|g|)| / |T|", f"{self.top_overlap:.4f}   (random {self.fraction:.4f})"),
            None,
            ("sqrt(E[a^2])", f"10^{self.log10_signal_scale:.2f}"),
            ("least sqrt(E[a^2]) holding on every F_i > 0", f"10^{self.log10_required_scale:.2f}"),
            ("share of coordinates where it holds (r_i <= 1)", f"{self.holds_share:.4%}"),
            ("coordinates with F_i = 0 < |g_i|", f"{self.unbounded:d}"),
            ("r_i = |g_i| / bound: median", f"{self.ratio_median:.3g}"),
            ("                     max", f"{self.ratio_max:.3g}"),
            ("                     share above 0.5", f"{self.above_half_share:.4%}"),
        ]
        head = [
            f"Anchor {self.anchor!r}: {plural(self.num_coordinates, 'coordinate', ',')}; SFT batch of "
            f"{plural(self.num_sequences, 'sequence')}, {plural(self.num_tokens, 'labelled token')}",
            f"g = (1/B) sum_b d/dtheta log pi(y_b|x_b); T(v) = the top {pct} coordinates of v",
        ]
        bound = "bound |g_i| <= sqrt(F_i) sqrt(E[a^2]), SFT's E[a^2] = mean_b (1/pi(y_b|x_b) - 1)"
        return "\n".join(head + [bound if row is None else f"  {row[0]:<48}{row[1]}" for row in rows])


def diagnose(model, anchor: FisherAnchor, input_ids, labels, attention_mask=None, batch_size: int = 8):
    """`GradientDiagnostics` of `anchor` against the SFT gradient g of one labelled batch (see the module
    docstring; `labelled_gradient`): `gradient_concentration` for the top 1% (where g's energy lies
    relative to F), and `fisher_bound` with SFT's E[a^2] = (1/B) sum_b (1/pi(y_b|x_b) - 1)
    (`sft_signal_log_second_moment`).

    The bound is exact for the Fisher of pi on the batch's own prompts (Cauchy-Schwarz per prompt, then
    over prompts). An anchor estimated on other prompts, from finitely many samples, or with a tempered
    or truncated sampler does not meet that condition: a violation (r_i > 1, `unbounded`) then measures
    that mismatch, not a failure of the inequality. Only the anchor's coordinates are read; its names
    must be the model's (`AnchorMismatchError` otherwise)."""
    return diagnose_anchors(model, [anchor], input_ids, labels, attention_mask, batch_size)[0]


def diagnose_anchors(model, anchors: Sequence[FisherAnchor], input_ids, labels, attention_mask=None, batch_size=8):
    """[`diagnose`(model, anchor, ...) for each anchor], the gradient taken once over all their parameters."""
    named = dict(named_parameters_once(model, trainable_only=False))
    for anchor in anchors:
        difference = layout_difference(anchor.fisher, {n: named[n] for n in anchor.fisher if n in named})
        if difference is not None:
            raise AnchorMismatchError(
                f"Anchor {anchor.name!r} does not fit the model (first: the anchor, second: the model): "
                f"{difference}. Diagnose with the model the anchor was estimated for."
            )
    names = list(dict.fromkeys(n for anchor in anchors for n in anchor.fisher))
    grads, log_probs, tokens = labelled_gradient(
        model, [named[n] for n in names], input_ids, labels, attention_mask, batch_size
    )
    gradient = {n: g.cpu() for n, g in zip(names, grads, strict=True)}
    log_second_moment = sft_signal_log_second_moment(log_probs)
    reports = []
    for anchor in anchors:
        fisher, own = list(anchor.fisher.values()), [gradient[n] for n in anchor.fisher]
        reports.append(
            GradientDiagnostics(
                anchor=anchor.name,
                num_coordinates=sum(f.numel() for f in fisher),
                num_sequences=len(input_ids),
                num_tokens=tokens,
                fisher_mass_share=anchor.metadata["statistics"]["top1pct_mass_share"],
                **gradient_concentration(own, fisher),
                **fisher_bound(own, fisher, log_second_moment),
            )
        )
    return reports
