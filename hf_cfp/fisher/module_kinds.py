"""Which kind of module owns a parameter: the module forwards whose per-sequence gradients have a formula.

A module has a kind only when its forward is known exactly; every kind names the parameters
(roles) it knows how to differentiate, in ``ROLES``. With a_t the input at position t, y_t the
output and g_t = d(score)/d y_t:

- ``"linear"``: ``nn.Linear`` with the stock forward (lm_head and PEFT LoRA's lora_A / lora_B
  included), y_t = W a_t + c.
- ``"conv1d"``: GPT-2 ``Conv1D`` with the stock forward, y_t = W^T a_t + c with W of shape
  (in, out).
- ``"embedding"``: ``nn.Embedding`` without ``max_norm`` or ``scale_grad_by_freq``, or a subclass
  that only scales its output by a constant (Gemma's), y_t = c W[i_t] for token ids i_t; c is
  1 for ``nn.Embedding`` itself and found by a numerical probe otherwise (``embedding_scale``).
- ``"norm"``: any leaf module with a 1-D ``weight`` (and optional same-shape ``bias``) whose
  output is affine and diagonal in them, y_t = y0(x_t) + w * d(x_t) + b elementwise over the
  last dimension: RMSNorm, LayerNorm (y0 = 0, d(x) = the normalized input), Gemma's (1 + w)
  norm (y0 != 0), a learned per-feature gain. Detected by a numerical probe, not by class name;
  ``norm_direction`` computes d(x) for a call.

The probes run once per module (results cached weakly, per module object).
"""

import weakref

import torch
from torch import nn
from torch.func import functional_call
from transformers.pytorch_utils import Conv1D  # GPT-2 style: weight is in x out

__all__ = ["ROLES", "embedding_scale", "layer_kind", "module_kind", "norm_direction"]

# The parameters each module kind knows how to differentiate.
ROLES = {
    "linear": ("weight", "bias"),
    "conv1d": ("weight", "bias"),
    "embedding": ("weight",),
    "norm": ("weight", "bias"),
}
_NORM_PROBES: "weakref.WeakKeyDictionary[nn.Module, bool | None]" = weakref.WeakKeyDictionary()
_EMBEDDING_SCALES: "weakref.WeakKeyDictionary[nn.Module, float | None]" = weakref.WeakKeyDictionary()


def module_kind(module: nn.Module) -> str | None:
    """The kind of `module` if the engine knows its forward exactly, else None."""
    if isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward:
        return "linear"
    if isinstance(module, Conv1D) and type(module).forward is Conv1D.forward:
        return "conv1d"
    if (
        isinstance(module, nn.Embedding)
        and module.max_norm is None
        and not module.scale_grad_by_freq
        and embedding_scale(module) is not None
    ):
        return "embedding"
    if _probe_affine_norm(module) is not None:
        return "norm"
    return None


def layer_kind(module: nn.Module) -> str | None:
    """ "linear" or "conv1d" when `module` is a layer y_t = W a_t + c with a 2-D weight whose inputs a_t and output
    gradients g_t the batched engine hands out (`batched.add_batched_squared_scores`' `layers` argument), else
    None."""
    kind = module_kind(module)
    if kind not in ("linear", "conv1d"):
        return None
    weight = module.weight
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return None
    return kind


def embedding_scale(module: nn.Embedding) -> float | None:
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
    if (
        not list(module.children())
        and weight is not None
        and weight.dim() == 1
        and set(own) <= {"weight", "bias"}
        and (bias is None or bias.shape == weight.shape)
        and weight.is_floating_point()
    ):
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


@torch.no_grad()
def norm_direction(module, args, kwargs):
    """For a module of kind "norm" called as module(*args, **kwargs): d(x) = y(w=1, b=0) - y(w=0, b=0),
    the derivative of the output with respect to w."""
    weight = module.weight
    bias = torch.zeros_like(weight) if getattr(module, "bias", None) is not None else None
    direction = _call_with(module, torch.ones_like(weight), bias, *args, **kwargs)
    if _NORM_PROBES[module]:  # nonzero offset y0
        direction = direction - _call_with(module, torch.zeros_like(weight), bias, *args, **kwargs)
    return direction


def _call_with(module, weight, bias, *args, **kwargs):
    """module(*args) with its weight (and bias) replaced, without touching the parameters."""
    values = {"weight": weight} if bias is None else {"weight": weight, "bias": bias}
    return functional_call(module, values, args, kwargs)
