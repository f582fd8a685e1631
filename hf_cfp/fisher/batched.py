"""Batched, exact per-sequence squared scores: one forward and one activation-only backward for B sequences.

For B sequences (x_b, y_b) the engine adds, for every covered parameter tensor theta,

    S(theta) = sum_b ( d/dtheta log mu(y_b | x_b) )^2                      (elementwise)

without ever holding the B x P per-sequence gradients. A layer's per-sequence gradient is a
contraction of two things backpropagation already has: the layer's input activations a and
the gradient g of sum_b log mu_b with respect to the layer's output (g_b depends on sequence
b only, since the sequences of a batch do not interact). So the engine

1. pads the batch (right padding, attention mask, explicit position ids) and runs one forward
   with hooks that keep each covered module's input and output;
2. backpropagates sum_b log mu_b to the captured *outputs* only, so autograd skips the
   weight-gradient products of a normal backward; a tensor hook on each output receives g as soon
   as autograd has it;
3. per parameter, once the last of its uses has arrived, forms G_b from (a_b, g_b) for a chunk of
   sequences, squares, adds into the float32 accumulator and discards the chunk
   (`per_sequence_grads`, which states the G_b formulas), then releases those (a, g).

Memory beyond a plain forward + backward: the float32 accumulators, one chunk of per-sequence
gradients (`chunk_size.default_chunk_elements`), and the (a, g) of parameters still waiting for a use
(a tied lm_head's, until the embedding's gradient arrives at the end of the backward).

Covered modules (`module_kinds` states what each kind means): ``nn.Linear`` (LoRA's included), GPT-2
``Conv1D``, ``nn.Embedding`` and constant-scaled subclasses (Gemma's), and affine norms with a 1-D
``weight`` found by a numerical probe (RMSNorm, LayerNorm, Gemma's (1 + w) norm). A parameter used in
several places (a tied embedding / lm_head, a module called twice) has its per-sequence contributions
summed before squaring.

Anything else falls back to the exact per-sequence loop (`scoring.sequence_log_prob` +
`scoring.add_squared_score`) for those parameters only, with one log line naming them:
parameters of unknown modules, parameters used outside their module (detected by counting
the parameter's uses in the autograd graph), and calls whose activations were modified in
place or are not laid out like the input ids.

Per-sequence attribution follows the (batch, time) layout of ``input_ids``, shape (B, T): a call
is used only if its input and output lead with exactly (B, T) (its token ids *are* (B, T) for an
embedding), so that row (b, t) holds position t of sequence b. A leading size that merely equals
B is no evidence: an MoE expert called on gathered tokens, ``expert(hidden.view(-1, H)[idx])``,
gets (n, H) with rows from any sequences, and n = B happens.
"""

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn
from transformers.utils import logging

from ..errors import CFPArgumentError, CFPError, plural
from ..geometry.base import LayerSums
from ..parallel.processes import log_on_main_process
from .backward import Consumer
from .chunk_size import default_chunk_elements
from .module_kinds import ROLES, module_kind, norm_direction
from .sampling import Sampler
from .scoring import PaddedBatch, add_squared_score, sequence_log_prob

logger = logging.get_logger(__name__)

__all__ = ["add_batched_squared_scores"]


def add_batched_squared_scores(
    model,
    params: list[torch.Tensor],
    accumulators: list[torch.Tensor],
    prompts: list[list[int]],
    responses: list[list[int]],
    sampler: Sampler,
    pad_id: int = 0,
    max_chunk_elements: int | None = None,
    supports: list[torch.Tensor | None] | None = None,
    layers: Mapping[int, LayerSums] | None = None,
) -> None:
    """accumulators[i] += sum_b (d/dparams[i] log mu(y_b | x_b))^2, exactly, for B sequences in one
    batched forward and backward, where log mu(y|x) = sum_t sampler.log_probs(logits_t)[y_t] over the
    response tokens only (what hf_cfp.fisher.scoring.sequence_log_prob computes for one sequence).

    For the weights in `layers` (index -> their `geometry.base.LayerSums`; their accumulator is None) the same pass
    hands over their layer's inputs a_t at every unpadded position in the forward hook and its output gradients
    g_t in the backward one instead (a sink sums S_A += sum a a^T and S_G += sum g g^T from them, K-FAC's factors).

    Args:
        model: a causal LM taking input_ids / attention_mask / position_ids; its train/eval mode
            is left as it is (call ``model.eval()`` first: dropout would make sequences differ
            from the per-sequence reference). No ``.grad`` is written; hooks are always removed.
        params: the parameters to cover, each once (a tied weight appears once). Parameters that
            do not require grad get no contribution.
        accumulators: float32 tensors shaped like ``params``, added to in place.
        prompts, responses: token ids per sequence; each prompt must be non-empty. Responses may
            end with EOS (it is scored like any other token) and have different lengths.
        sampler: the distribution mu whose log-probability is differentiated.
        pad_id: token id written into padding positions (they are masked out of the score).
        max_chunk_elements: sequences are processed in chunks so that one chunk's per-sequence
            gradient of a parameter has at most this many elements (at least one sequence); the
            result does not depend on it. None (default): chosen from the memory available when
            the backward starts (`chunk_size.default_chunk_elements`).
        supports: the support of mu each response token was drawn from, packed, one entry per
            response (`sampling.sample_with_supports`); None recomputes it from the scoring logits.
            A response token of probability 0 under mu raises CFPArgumentError.
        layers: the weights whose layer inputs and output gradients are handed over, by index into `params` (a
            layer's weight, `module_kinds.layer_kind`); CFPError when one cannot be hooked (used outside its module).
    """
    _check_batch(params, accumulators, prompts, responses)
    layers = layers or {}
    live = [i for i, p in enumerate(params) if p.requires_grad]
    if not live or not any(responses):
        return
    batch = PaddedBatch(prompts, responses, pad_id, params[live[0]].device, supports)
    owners, fallback = _find_owners(model, params, live)

    mask = batch.mask.bool()  # the unpadded positions, for the layer sums
    tracer = _Tracer(owners, layers, mask)
    try:
        logits = model(
            input_ids=batch.ids, attention_mask=batch.mask, position_ids=batch.positions, use_cache=False
        ).logits
    finally:
        tracer.remove()
    total = batch.response_log_prob(logits, sampler)  # sum_b log mu(y_b | x_b)
    del logits

    calls = [c for c in tracer.calls if isinstance(c.out, torch.Tensor) and c.out.requires_grad]
    fallback |= _invalid_call_params(calls, owners, tuple(batch.ids.shape))
    fallback |= _params_used_elsewhere(total, calls, owners, params, live, fallback)
    _refuse_layer_fallback(model, params, fallback, layers)
    _log_fallback(model, params, fallback)

    calls = [c for c in calls if c.reachable and any(i not in fallback for i in owners[c.module][1].values())]
    del tracer  # its record of the calls left out is not needed
    if max_chunk_elements is None:
        max_chunk_elements = default_chunk_elements(batch.ids.device)
    if calls:
        consumer = Consumer(calls, owners, fallback, accumulators, batch.size, max_chunk_elements, layers, mask)
        consumer.backward(total)
    del total, calls

    if fallback:  # the plain, exact loop, for the parameters the hooks cannot handle
        fb = sorted(fallback)
        for prompt, response, support in zip(prompts, responses, supports or [None] * len(prompts), strict=True):
            add_squared_score(
                [accumulators[i] for i in fb],
                [params[i] for i in fb],
                sequence_log_prob(model, prompt, response, sampler, support),
            )


def _check_batch(params, accumulators, prompts, responses) -> None:
    """CFPArgumentError unless there is one accumulator per parameter, one response per prompt, and no empty
    prompt."""
    if len(params) != len(accumulators):
        raise CFPArgumentError(
            f"Got {plural(len(params), 'param')} but {plural(len(accumulators), 'accumulator')}; give one each."
        )
    if len(prompts) != len(responses):
        raise CFPArgumentError(
            f"Got {plural(len(prompts), 'prompt')} but {plural(len(responses), 'response')}; give one each."
        )
    if any(len(prompt) == 0 for prompt in prompts):
        raise CFPArgumentError("An empty prompt has no position to predict the first response token from.")


# ----------------------------------------------------------------------------- which parameters are covered


def _find_owners(model, params, live):
    """owners: module -> (kind, {role: param index}) for the modules whose parameters the hooks cover;
    fallback: indices of live parameters that no known module owns (or an unknown one also owns)."""
    index = {id(params[i]): i for i in live}
    owned, fallback, owners = set(), set(), {}
    for module in model.modules():
        own = {name: index[id(p)] for name, p in module.named_parameters(recurse=False) if id(p) in index}
        if not own:
            continue
        owned |= set(own.values())
        kind = module_kind(module)
        known = {role: i for role, i in own.items() if kind is not None and role in ROLES[kind]}
        fallback |= set(own.values()) - set(known.values())
        if known:
            owners[module] = (kind, known)
    fallback |= set(live) - owned
    owners = {
        module: (kind, {role: i for role, i in own.items() if i not in fallback})
        for module, (kind, own) in owners.items()
    }
    return {module: entry for module, entry in owners.items() if entry[1]}, fallback


# ----------------------------------------------------------------------------- the forward


@dataclass
class _Call:
    """One call of a covered module: x is its input activation (linear, conv1d), its token ids
    (embedding) or the weight direction d(x) (norm); out its output."""

    module: nn.Module
    x: object
    out: object
    versions: tuple
    reachable: bool = False


class _Tracer:
    """Forward hooks on the covered modules that record every call, and hand the inputs of the `layers` weights at
    the unpadded positions (`mask`, (B, T)) to their sums (`LayerSums.add_inputs`: the rows, or their Gram matrix
    sum_t a a^T); a Gram matrix is formed once for consecutive calls on the same input (q, k and
    v projections read one tensor)."""

    def __init__(self, owners, layers: Mapping[int, LayerSums], mask: torch.Tensor):
        self.owners, self.busy = owners, False
        self.calls: list[_Call] = []
        self.layers, self.mask = layers, mask
        self.last_gram: tuple[object, torch.Tensor | None] = (None, None)  # (input, its Gram matrix)
        self.handles = [m.register_forward_hook(self._hook, with_kwargs=True) for m in owners]

    def _hook(self, module, args, kwargs, output):
        if self.busy:  # our own recomputation inside a norm hook
            return
        x = args[0] if args else next(iter(kwargs.values()), None)
        if self.owners[module][0] == "norm" and isinstance(x, torch.Tensor):
            self.busy = True
            try:
                x = norm_direction(module, args, kwargs)
            finally:
                self.busy = False
        self.calls.append(_Call(module, x, output, _versions(x, output)))
        factored = [self.layers[i] for i in self.owners[module][1].values() if i in self.layers]
        if factored and isinstance(x, torch.Tensor) and tuple(x.shape[:2]) == tuple(self.mask.shape):
            for sums in factored:
                sums.add_inputs(lambda: x[self.mask].float(), lambda: self._gram(x))

    @torch.no_grad()
    def _gram(self, x: torch.Tensor) -> torch.Tensor:
        """sum over the unpadded positions of x_t x_t^T, float32 (reused when the same input comes again)."""
        if self.last_gram[0] is not x:
            rows = x[self.mask].float()
            self.last_gram = (x, rows.T @ rows)
        gram = self.last_gram[1]
        assert gram is not None
        return gram

    def remove(self):
        for handle in self.handles:
            handle.remove()
        self.handles = []


def _versions(*tensors):
    return tuple(t._version if isinstance(t, torch.Tensor) else None for t in tensors)


# ----------------------------------------------------------------------------- fallback detection


def _invalid_call_params(calls, owners, layout: tuple[int, ...]) -> set[int]:
    """Params of modules with a call the formulas cannot use: input or output not led by the
    (batch, time) `layout` of the input ids (B, T) -- e.g. gathered tokens (n, H), even when n = B --,
    shapes that do not match the kind, or an input / output modified in place later."""
    bad = set()
    for call in calls:
        kind, own = owners[call.module]
        x, out = call.x, call.out
        ok = (
            isinstance(x, torch.Tensor)
            and isinstance(out, torch.Tensor)
            and tuple(x.shape[:2]) == layout
            and tuple(out.shape[:2]) == layout
            and out.dim() >= 3
            and _versions(x, out) == call.versions
        )
        if ok and kind in ("linear", "conv1d"):
            ok = x.shape[:-1] == out.shape[:-1]
        elif ok and kind == "embedding":
            ok = out.shape[:-1] == x.shape and not x.is_floating_point()
        elif ok and kind == "norm":
            ok = x.shape == out.shape
        if not ok:
            bad |= set(own.values())
    return bad


def _params_used_elsewhere(total, calls, owners, params, live, fallback) -> set[int]:
    """Params whose number of uses in the autograd graph differs from the number of hooked calls
    that reach the score: such a parameter is also used outside its module (e.g. a parent reads
    `child.weight`), which the hooks would miss. Marks each call as reachable or not."""
    wanted = {id(params[i]): i for i in live}
    uses, reachable = _graph_uses(total, wanted)
    expected = dict.fromkeys(live, 0)
    for call in calls:
        call.reachable = call.out.grad_fn in reachable
        if call.reachable:
            for i in owners[call.module][1].values():
                expected[i] += 1
    return {i for i in live if i not in fallback and expected[i] != uses.get(i, 0)}


def _graph_uses(root: torch.Tensor, wanted: dict[int, int]):
    """Count, for each wanted leaf, the autograd edges pointing to it; also return all nodes seen."""
    counts: dict[int, int] = {}
    seen: set = set()
    stack = [root.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for child, _ in node.next_functions:
            if child is None:
                continue
            variable = getattr(child, "variable", None)
            if variable is not None:  # AccumulateGrad: a leaf
                if id(variable) in wanted:
                    counts[wanted[id(variable)]] = counts.get(wanted[id(variable)], 0) + 1
            else:
                stack.append(child)
    return counts, seen


def _refuse_layer_fallback(model, params, fallback, layers) -> None:
    """CFPError naming the weights whose layer sums the hooks cannot follow: they need every call's
    input and output gradient, which the per-sequence loop does not see."""
    refused = sorted(i for i in fallback if i in layers)
    if refused:
        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        listed = ", ".join(names.get(id(params[i]), f"params[{i}]") for i in refused)
        raise CFPError(
            f"structure='kfac': the weights {listed} are used outside their Linear module (or on activations not "
            "laid out (batch, time)), so their Kronecker factors cannot be formed. Estimate this model with "
            "structure='diagonal'."
        )


def _log_fallback(model, params, fallback):
    if not fallback:
        return
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    listed = sorted(names.get(id(params[i]), f"params[{i}]") for i in fallback)
    log_on_main_process(  # once per process and set of parameters, not once per batch
        logger.warning_once,
        "Batched Fisher engine: %d parameter tensor(s) not covered by its module formulas (unknown module, "
        "used outside it, modified in place, or called on activations not laid out (batch, time) like "
        "input_ids, e.g. gathered MoE tokens) use the exact per-sequence loop instead (slower): %s",
        len(listed),
        ", ".join(listed),
    )
