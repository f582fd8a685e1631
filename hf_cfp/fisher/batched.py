"""Batched, exact per-sequence squared scores: one forward and one activation-only backward for B sequences.

For B sequences (x_b, y_b) the engine adds, for every covered parameter tensor theta,

    S(theta) = sum_b ( d/dtheta log mu(y_b | x_b) )^2                      (elementwise)

without ever holding the B x P per-sequence gradients. A layer's per-sequence gradient is a
contraction of two things backpropagation already has: the layer's input activations a and
the gradient g of sum_b log mu_b with respect to the layer's output (g_b depends on sequence
b only, since the sequences of a batch do not interact). So the engine

1. pads the batch (right padding, attention mask, explicit position ids) and runs one forward
   with hooks that keep each covered module's input and output;
2. calls ``torch.autograd.grad(sum_b log mu_b, outputs)`` -- gradients with respect to the
   captured *outputs* only, so autograd skips the weight-gradient products of a normal backward;
3. per parameter, forms G_b from (a_b, g_b) for a chunk of sequences, squares, adds into the
   float32 accumulator and discards the chunk.

Covered module kinds (one function each below; formulas in their docstrings): ``nn.Linear``
(lm_head and PEFT LoRA's lora_A / lora_B included), GPT-2 ``Conv1D``, ``nn.Embedding`` (and
subclasses that only scale its output by a constant, like Gemma's), and
any leaf module whose output is affine and diagonal in a 1-D ``weight`` (plus optional
``bias``): RMSNorm, LayerNorm, Gemma's (1 + w) norm, a learned per-feature gain -- detected
by a numerical probe, not by class name. A parameter used in several places (a tied
embedding / lm_head, a module called twice) has its per-sequence contributions summed
before squaring.

Anything else falls back to the exact per-sequence loop (`scoring.sequence_log_prob` +
`scoring.add_squared_score`) for those parameters only, with one log line naming them:
parameters of unknown modules, parameters used outside their module (detected by counting
the parameter's uses in the autograd graph), and calls whose activations were modified in
place or whose leading dimension is not the batch.
"""

import logging
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call

from ..errors import CFPArgumentError
from .sampling import Sampler
from .scoring import add_squared_score, sequence_log_prob

try:  # GPT-2 style Conv1D (weight is in x out)
    from transformers.pytorch_utils import Conv1D
except ImportError:  # pragma: no cover - transformers is a dependency
    Conv1D = None

logger = logging.getLogger(__name__)

__all__ = ["add_batched_squared_scores"]

# The parameters each module kind knows how to differentiate.
_ROLES = {"linear": ("weight", "bias"), "conv1d": ("weight", "bias"), "embedding": ("weight",),
          "norm": ("weight", "bias")}
_NORM_PROBES: "weakref.WeakKeyDictionary[nn.Module, bool | None]" = weakref.WeakKeyDictionary()
_EMBEDDING_SCALES: "weakref.WeakKeyDictionary[nn.Module, float | None]" = weakref.WeakKeyDictionary()
_LOGGED: "weakref.WeakKeyDictionary[nn.Module, set]" = weakref.WeakKeyDictionary()


def add_batched_squared_scores(model, params: list[torch.Tensor], accumulators: list[torch.Tensor],
                               prompts: list[list[int]], responses: list[list[int]], sampler: Sampler,
                               pad_id: int = 0, max_chunk_elements: int = 2**26) -> None:
    """accumulators[i] += sum_b (d/dparams[i] log mu(y_b | x_b))^2, exactly, for B sequences in one
    batched forward and backward, where log mu(y|x) = sum_t sampler.log_probs(logits_t)[y_t] over the
    response tokens only (what hf_cfp.fisher.scoring.sequence_log_prob computes for one sequence).

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
            gradient of a parameter has at most this many elements (at least one sequence).
    """
    if len(params) != len(accumulators):
        raise CFPArgumentError(f"Got {len(params)} params but {len(accumulators)} accumulators; give one each.")
    if len(prompts) != len(responses):
        raise CFPArgumentError(f"Got {len(prompts)} prompts but {len(responses)} responses; give one each.")
    if any(len(prompt) == 0 for prompt in prompts):
        raise CFPArgumentError("An empty prompt has no position to predict the first response token from.")
    live = [i for i, p in enumerate(params) if p.requires_grad]
    if not live or not any(responses):
        return
    batch = _Batch(prompts, responses, pad_id, params[live[0]].device)
    owners, fallback = _find_owners(model, params, live)

    tracer = _Tracer(owners)
    try:
        logits = model(input_ids=batch.ids, attention_mask=batch.mask, position_ids=batch.positions,
                       use_cache=False).logits
    finally:
        tracer.remove()
    total = batch.response_log_prob(logits, sampler)  # sum_b log mu(y_b | x_b)
    del logits

    calls = [c for c in tracer.calls if isinstance(c.out, torch.Tensor) and c.out.requires_grad]
    fallback |= _invalid_call_params(calls, owners, batch.size)
    fallback |= _params_used_elsewhere(total, calls, owners, params, live, fallback)
    _log_fallback(model, params, fallback)

    calls = [c for c in calls if c.reachable and any(i not in fallback for i in owners[c.module][1].values())]
    grads = torch.autograd.grad(total, [c.out for c in calls], allow_unused=True) if calls else ()
    del total
    uses: dict[int, list[_Use]] = {}
    for call, grad in zip(calls, grads):
        kind, own = owners[call.module]
        for role, i in own.items():
            if i not in fallback and grad is not None:
                uses.setdefault(i, []).append(_Use(kind, role, call.x.detach(), grad, call.module))
    del calls, grads
    with torch.no_grad():  # the captured activations still carry the forward graph
        for i, param_uses in uses.items():
            _accumulate(accumulators[i], param_uses, batch.size, max_chunk_elements)
    del uses

    if fallback:  # the plain, exact loop, for the parameters the hooks cannot handle
        fb = sorted(fallback)
        for prompt, response in zip(prompts, responses):
            add_squared_score([accumulators[i] for i in fb], [params[i] for i in fb],
                              sequence_log_prob(model, prompt, response, sampler))


# ----------------------------------------------------------------------------- the batch


class _Batch:
    """Right-padded prompt+response ids. Right padding keeps every real token's causal context
    free of padding, so no attention row is fully masked and padding cannot leak into a score."""

    def __init__(self, prompts, responses, pad_id, device):
        self.size = len(prompts)
        seqs = [list(p) + list(r) for p, r in zip(prompts, responses)]
        width = max(len(s) for s in seqs)
        rows, cols, targets = [], [], []
        for b, (prompt, response) in enumerate(zip(prompts, responses)):
            rows += [b] * len(response)  # position t predicts token t + 1
            cols += range(len(prompt) - 1, len(prompt) + len(response) - 1)
            targets += response
        self.ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in seqs], device=device)
        self.mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs], device=device)
        self.positions = (self.mask.cumsum(-1) - 1).clamp(min=0)
        self.rows, self.cols = torch.tensor(rows, device=device), torch.tensor(cols, device=device)
        self.targets = torch.tensor(targets, dtype=torch.long, device=device)

    def response_log_prob(self, logits: torch.Tensor, sampler: Sampler) -> torch.Tensor:
        """sum_b sum_{t in response_b} log mu(y_{b,t} | prefix): padding and prompts masked out."""
        scored = sampler.log_probs(logits[self.rows, self.cols])
        return scored.gather(1, self.targets.unsqueeze(1)).sum()


# ----------------------------------------------------------------------------- which modules


def _module_kind(module: nn.Module) -> str | None:
    """The kind of `module` if the engine knows its forward exactly, else None."""
    if isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward:
        return "linear"
    if Conv1D is not None and isinstance(module, Conv1D) and type(module).forward is Conv1D.forward:
        return "conv1d"
    if (isinstance(module, nn.Embedding) and module.max_norm is None and not module.scale_grad_by_freq
            and _embedding_scale(module) is not None):
        return "embedding"
    if _probe_affine_norm(module) is not None:
        return "norm"
    return None


def _embedding_scale(module: nn.Embedding) -> float | None:
    """c such that module(ids) = c * W[ids] (1 for nn.Embedding itself; e.g. sqrt(hidden) for Gemma's
    scaled embedding subclass), checked numerically with a random weight; None if no such c."""
    if type(module).forward is nn.Embedding.forward:
        return 1.0
    if module not in _EMBEDDING_SCALES:
        _EMBEDDING_SCALES[module] = None
        try:
            _EMBEDDING_SCALES[module] = _run_embedding_probe(module)
        except Exception:  # cannot run on a (2, 3) batch of ids: not an embedding here
            pass
    return _EMBEDDING_SCALES[module]


@torch.no_grad()
def _run_embedding_probe(module) -> float | None:
    weight = module.weight
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, module.num_embeddings, (2, 3), generator=generator).to(weight.device)
    random_weight = torch.randn(weight.shape, generator=generator).to(weight)
    unit = functional_call(module, {"weight": torch.ones_like(weight)}, (ids,))
    out = functional_call(module, {"weight": random_weight}, (ids,))
    scale = unit.flatten()[0]
    expected = scale * nn.functional.embedding(ids, random_weight)
    tol = 16 * torch.finfo(out.dtype).eps
    if out.shape != expected.shape or not torch.equal(unit, torch.full_like(unit, float(scale))):
        return None
    if not torch.allclose(out, expected, rtol=tol, atol=tol * float(expected.abs().max())):
        return None
    return float(scale)


def _probe_affine_norm(module: nn.Module) -> bool | None:
    """Whether a leaf module with a 1-D `weight` (and optional same-shape `bias`) computes

        y = y0(x) + w * d(x) + b        (elementwise over the last dimension),

    checked numerically on a random input with a random weight and bias. Returns None when it
    does not, else whether the offset y0 (the output at w = 0, b = 0) is nonzero (Gemma-style
    (1 + w) norms). RMSNorm and LayerNorm have y0 = 0 and d(x) = the normalized input."""
    if module in _NORM_PROBES:
        return _NORM_PROBES[module]
    result = None
    own = {name: p for name, p in module.named_parameters(recurse=False)}
    weight, bias = own.get("weight"), own.get("bias")
    if (not list(module.children()) and weight is not None and weight.dim() == 1 and set(own) <= {"weight", "bias"}
            and (bias is None or bias.shape == weight.shape) and weight.is_floating_point()):
        try:
            result = _run_norm_probe(module, weight, bias)
        except Exception:  # any module that cannot run on a (2, 3, H) input is not a norm here
            result = None
    _NORM_PROBES[module] = result
    return result


@torch.no_grad()
def _run_norm_probe(module, weight, bias) -> bool | None:
    generator = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=generator).to(weight)

    x, w, b = rand(2, 3, weight.numel()), rand(weight.numel()), rand(weight.numel())
    one, zero = torch.ones_like(weight), torch.zeros_like(weight)
    out = _call_with(module, w, b if bias is not None else None, x)
    unit = _call_with(module, one, zero if bias is not None else None, x)
    offset = _call_with(module, zero, zero if bias is not None else None, x)
    expected = offset + w * (unit - offset) + (b if bias is not None else 0)
    if not isinstance(out, torch.Tensor) or out.shape != expected.shape:
        return None
    tol = 16 * torch.finfo(out.dtype).eps
    if not torch.allclose(out, expected, rtol=tol, atol=tol * float(expected.abs().max())):
        return None
    return bool(offset.abs().max() > 0)


def _call_with(module, weight, bias, *args, **kwargs):
    """module(*args) with its weight (and bias) replaced, without touching the parameters."""
    values = {"weight": weight} if bias is None else {"weight": weight, "bias": bias}
    return functional_call(module, values, args, kwargs)


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
        kind = _module_kind(module)
        known = {role: i for role, i in own.items() if kind is not None and role in _ROLES[kind]}
        fallback |= set(own.values()) - set(known.values())
        if known:
            owners[module] = (kind, known)
    fallback |= set(live) - owned
    owners = {module: (kind, {role: i for role, i in own.items() if i not in fallback})
              for module, (kind, own) in owners.items()}
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
    """Forward hooks on the covered modules that record every call."""

    def __init__(self, owners):
        self.owners, self.calls, self.busy = owners, [], False
        self.handles = [m.register_forward_hook(self._hook, with_kwargs=True) for m in owners]

    def _hook(self, module, args, kwargs, output):
        if self.busy:  # our own recomputation inside a norm hook
            return
        x = args[0] if args else next(iter(kwargs.values()), None)
        if self.owners[module][0] == "norm" and isinstance(x, torch.Tensor):
            self.busy = True
            try:
                x = _norm_direction(module, args, kwargs)
            finally:
                self.busy = False
        self.calls.append(_Call(module, x, output, _versions(x, output)))

    def remove(self):
        for handle in self.handles:
            handle.remove()
        self.handles = []


def _versions(*tensors):
    return tuple(t._version if isinstance(t, torch.Tensor) else None for t in tensors)


@torch.no_grad()
def _norm_direction(module, args, kwargs):
    """d(x) = y(w=1, b=0) - y(w=0, b=0): the derivative of the output with respect to w."""
    weight = module.weight
    bias = torch.zeros_like(weight) if getattr(module, "bias", None) is not None else None
    direction = _call_with(module, torch.ones_like(weight), bias, *args, **kwargs)
    if _NORM_PROBES[module]:  # nonzero offset y0
        direction = direction - _call_with(module, torch.zeros_like(weight), bias, *args, **kwargs)
    return direction


def _invalid_call_params(calls, owners, batch_size) -> set[int]:
    """Params of modules with a call the formulas cannot use: the leading dimension is not the
    batch, shapes do not match the kind, or the input / output was modified in place later."""
    bad = set()
    for call in calls:
        kind, own = owners[call.module]
        x, out = call.x, call.out
        ok = (isinstance(x, torch.Tensor) and isinstance(out, torch.Tensor) and x.dim() >= 1 and out.dim() >= 2
              and x.shape[0] == batch_size and out.shape[0] == batch_size and _versions(x, out) == call.versions)
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
    counts, seen, stack = {}, set(), [root.grad_fn]
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


def _log_fallback(model, params, fallback):
    if not fallback:
        return
    names = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    listed = sorted(names.get(id(params[i]), f"params[{i}]") for i in fallback)
    logged = _LOGGED.setdefault(model, set())
    if tuple(listed) not in logged:  # once per model and set of parameters, not once per batch
        logged.add(tuple(listed))
        logger.warning("Batched Fisher engine: %d parameter tensor(s) not covered by its module formulas use the "
                       "exact per-sequence loop instead (slower): %s", len(listed), ", ".join(listed))


# ----------------------------------------------------------------------------- per-sequence gradients


@dataclass
class _Use:
    """One use of a parameter: (x, g) of one call of its module, batch first."""

    kind: str
    role: str
    x: torch.Tensor
    g: torch.Tensor
    module: nn.Module

    @property
    def sparse(self) -> bool:
        return self.kind == "embedding"

    def per_sequence_size(self, param_numel: int) -> int:
        return self.g[0].numel() if self.sparse else param_numel

    def dense(self, b0: int, b1: int) -> torch.Tensor:
        """G_b for b in [b0, b1) (not for embeddings), shape (b1 - b0, *param.shape), float32."""
        return _DENSE[self.kind](self.role, _flat(self.x, b0, b1), _flat(self.g, b0, b1))

    def rows(self, b0: int, b1: int):
        """Embeddings only: G_b for b in [b0, b1) as sparse (keys, rows), see `_embedding_rows`."""
        return _embedding_rows(self.module, self.x[b0:b1], self.g[b0:b1])


def _flat(t: torch.Tensor, b0: int, b1: int) -> torch.Tensor:
    """Sequences b0..b1 as (c, positions, features) in float32."""
    t = t[b0:b1]
    return t.reshape(t.shape[0], -1, t.shape[-1]).float()


def _linear_grad(role, a, g):
    """nn.Linear, y_t = W a_t + c:  G_W[b] = sum_t g_{b,t} a_{b,t}^T,  G_c[b] = sum_t g_{b,t}."""
    return torch.bmm(g.transpose(1, 2), a) if role == "weight" else g.sum(1)


def _conv1d_grad(role, a, g):
    """GPT-2 Conv1D, y_t = W^T a_t + c with W of shape (in, out):  G_W[b] = sum_t a_{b,t} g_{b,t}^T,
    G_c[b] = sum_t g_{b,t}."""
    return torch.bmm(a.transpose(1, 2), g) if role == "weight" else g.sum(1)


def _norm_grad(role, d, g):
    """Affine norm, y_t = y0(x_t) + w * d(x_t) + c:  G_w[b] = sum_t g_{b,t} * d(x_{b,t}),
    G_c[b] = sum_t g_{b,t}. For RMSNorm / LayerNorm d(x) is the normalized input x_hat."""
    return (g * d).sum(1) if role == "weight" else g.sum(1)


_DENSE = {"linear": _linear_grad, "conv1d": _conv1d_grad, "norm": _norm_grad}


def _embedding_rows(module: nn.Embedding, ids: torch.Tensor, g: torch.Tensor):
    """nn.Embedding, y_t = c W[i_t] (c = 1, or a constant scale):
    G[b] = c sum_t e_{i_{b,t}} g_{b,t}^T, nonzero only on the rows sequence b uses.

    Returned sparse: (keys, rows) with key = local_b * vocab + i_{b,t} and row = c g_{b,t}; repeated
    keys are summed later. Positions holding padding_idx get no gradient, as in nn.Embedding."""
    local = torch.arange(ids.shape[0], device=ids.device).view(-1, *([1] * (ids.dim() - 1)))
    keys = (local * module.num_embeddings + ids).reshape(-1)
    rows = g.reshape(-1, g.shape[-1]).float()
    scale = _embedding_scale(module)
    if scale != 1.0:
        rows = rows * scale
    if module.padding_idx is not None:
        keep = ids.reshape(-1) != module.padding_idx
        keys, rows = keys[keep], rows[keep]
    return keys, rows


def _accumulate(acc: torch.Tensor, uses: list[_Use], batch_size: int, max_chunk_elements: int) -> None:
    """acc += sum_b (sum_u G_{u,b})^2: the uses of one parameter are summed per sequence before squaring,
    in chunks of sequences whose per-sequence gradients hold at most max_chunk_elements elements."""
    sparse = all(use.sparse for use in uses)
    per_sequence = max(use.per_sequence_size(acc.numel()) for use in uses) if sparse else acc.numel()
    step = max(1, max_chunk_elements // max(1, per_sequence))
    for b0 in range(0, batch_size, step):
        b1 = min(batch_size, b0 + step)
        if sparse:  # only the rows the sequences use: sum rows per (sequence, row) key, square, scatter-add
            parts = [use.rows(b0, b1) for use in uses]
            keys = torch.cat([k for k, _ in parts])
            unique, inverse = keys.unique(return_inverse=True)
            summed = torch.zeros(len(unique), acc.shape[-1], dtype=torch.float32, device=acc.device)
            summed.index_add_(0, inverse, torch.cat([r for _, r in parts]))
            acc.index_add_(0, unique % acc.shape[0], summed.square_())
            continue
        dense = [use for use in uses if not use.sparse]
        total = dense[0].dense(b0, b1)
        for use in dense[1:]:
            total.add_(use.dense(b0, b1))
        for use in uses:  # a tied embedding: its rows are added into lm_head's dense per-sequence gradient
            if use.sparse:
                keys, rows = use.rows(b0, b1)
                total.view(-1, acc.shape[-1]).index_add_(0, keys, rows)
        acc.add_(total.square_().sum(0))
