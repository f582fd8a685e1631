"""A base-model anchor on a `peft.PeftModel` (LoRA): PEFT's names mapped to the base model's, drift in base space.

An anchor is keyed by the base model's names (`model.layers.0.self_attn.q_proj.weight`). Wrapped by PEFT, the
weight standing at that name is one of:

- adapted: the frozen base weight W0 behind a LoRA layer (`...q_proj.base_layer.weight`). It moves in the
  merged model by Delta_W = sum over active adapters a of s_a B_a A_a, minus that sum at bind (s B0 A0: zero
  for PEFT's default init, nonzero for PiSSA / OLoRA / LoftQ), transposed when `fan_in_fan_out`;
- trained in place: a `modules_to_save` copy (`...lm_head.modules_to_save.default.weight`) or a base parameter
  left trainable (a bias with `bias="all"`): an ordinary parameter, bound as on a full model;
- frozen and unadapted: it cannot move, and is ignored as on a full model.

So the drift measured on a PeftModel is that of `merge_and_unload()` against the base weights; the correction
of the LoRA factors is `adapter_correction`.

QLoRA: W0 may be a bitsandbytes 4-bit or 8-bit weight (PEFT's `lora.bnb.Linear4bit` / `Linear8bitLt`). The
adapter is full precision and the layer computes dequant(W0) x + s B A x, so Delta_W is the same exact
s B A - s0 B0 A0; W0 itself enters only by its name and logical shape (`hf_cfp.quantized`). (A 4-bit
`merge_and_unload()` re-quantizes the merged weight, so it is not the reference there.)

peft is optional (the `peft` extra) and is never imported by this module until a PeftModel is found: a PeftModel
can exist only once peft has been imported, so `find_peft_model` first looks for "peft" in `sys.modules` and,
without it, knows there is none (a plain model costs no import and no walk over its modules).
"""

import functools
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.tensor import DTensor

from ..errors import CFPError
from ..geometry.lora import LoraFactors
from ..ops import DriftView, drift_squares

if TYPE_CHECKING:  # peft's types, for type checkers only (peft is imported once a PeftModel exists)
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import ModulesToSaveWrapper
    from peft.utils.other import AuxiliaryTrainingWrapper

    PeftClasses = tuple[
        type[LoraLayer], type[ModulesToSaveWrapper], type[BaseTunerLayer], type[AuxiliaryTrainingWrapper]
    ]


@dataclass(eq=False)
class AdaptedWeight:
    """The frozen base weight W0 of one LoRA `Linear` layer and the snapshot of its LoRA factors at bind.

    `displacement()` = sum_a s_a B_a A_a - sum_a s0_a B0_a A0_a (transposed when `fan_in_fan_out`), float32:
    the merged weight minus its value at bind.
    """

    name: str  # the base model's name of W0
    layer: "LoraLayer"  # a LoRA Linear, or PEFT's bitsandbytes 4-/8-bit Linear (QLoRA)
    adapters: tuple[str, ...]
    snapshot: list[tuple[float, torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (s0, B0, A0) each

    def __post_init__(self) -> None:
        self.snapshot = [
            (
                float(self.layer.scaling[a]),
                _weight(self.layer.lora_B, a).clone(),
                _weight(self.layer.lora_A, a).clone(),
            )
            for a in self.adapters
        ]

    @property
    def device(self) -> torch.device:
        """Where the LoRA factors live (those of the first active adapter)."""
        weight = self.layer.lora_B[self.adapters[0]].weight
        assert isinstance(weight, torch.Tensor)
        return weight.device

    def factors(self) -> list[LoraFactors]:
        """Each active adapter's factors now and at bind, float32."""
        return [
            LoraFactors(
                float(self.layer.scaling[a]), _weight(self.layer.lora_B, a), _weight(self.layer.lora_A, a), s0, b0, a0
            )
            for a, (s0, b0, a0) in zip(self.adapters, self.snapshot, strict=True)
        ]

    def in_factor_orientation(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor shaped like W0 seen as B A is (out x in): transposed when `fan_in_fan_out` (GPT-2's Conv1D
        layout; bitsandbytes layers do not have the flag)."""
        return tensor.T if getattr(self.layer, "fan_in_fan_out", False) else tensor

    @torch.no_grad()
    def displacement(self) -> torch.Tensor:
        """Delta_W = sum_a (s_a B_a A_a - s0_a B0_a A0_a), shaped like W0, float32 (one layer at a time)."""
        return self.in_factor_orientation(torch.stack([f.displacement() for f in self.factors()]).sum(0))

    @torch.no_grad()
    def write(self, b: torch.Tensor, a: torch.Tensor) -> None:
        """Set the (single) active adapter's factors to `b`, `a` (cast to the factors' dtype)."""
        (adapter,) = self.adapters
        for modules, value in ((self.layer.lora_B, b), (self.layer.lora_A, a)):
            weight = modules[adapter].weight
            assert isinstance(weight, torch.Tensor)
            if value.data_ptr() != weight.data_ptr():  # a factor the rule left in place is not copied onto itself
                weight.copy_(value)


def _weight(modules: torch.nn.ModuleDict, adapter: str) -> torch.Tensor:
    """`modules[adapter].weight` (a LoRA factor), detached, float32 (the parameter itself when it is float32)."""
    weight = modules[adapter].weight
    assert isinstance(weight, torch.Tensor)
    return weight.detach().float()


@dataclass
class PeftView:
    """A PeftModel seen through the base model's names.

    `params`: name -> the tensor standing there in the merged model (a `modules_to_save` copy, else the base
    parameter; frozen ones included); `base`: name -> the base model's own tensor (the fingerprint's view);
    `adapted`: name -> the LoRA-adapted base weights.
    """

    params: dict[str, torch.Tensor]
    base: dict[str, torch.Tensor]
    adapted: dict[str, AdaptedWeight]


def find_peft_model(model: torch.nn.Module) -> "PeftModel | None":
    """The PeftModel that is `model` or that a wrapper (DDP, torch.compile) holds; None if there is none, at once
    when peft was never imported (then no PeftModel can exist)."""
    if "peft" not in sys.modules:
        return None
    from peft import PeftModel  # optional (the `peft` extra): imported already, as a PeftModel may exist

    return next((m for m in model.modules() if isinstance(m, PeftModel)), None)


@functools.cache
def _peft_classes() -> "PeftClasses":
    """(LoraLayer, ModulesToSaveWrapper, BaseTunerLayer, AuxiliaryTrainingWrapper): the PEFT modules `_walk`
    recognizes, imported once, after a PeftModel was found."""
    from peft.tuners.lora import LoraLayer  # optional (the `peft` extra): reached only once a PeftModel exists
    from peft.tuners.tuners_utils import BaseTunerLayer  # (ditto)
    from peft.utils import ModulesToSaveWrapper  # (ditto)
    from peft.utils.other import AuxiliaryTrainingWrapper  # (ditto)

    return LoraLayer, ModulesToSaveWrapper, BaseTunerLayer, AuxiliaryTrainingWrapper


def peft_view(model: torch.nn.Module) -> PeftView | None:
    """`model` seen through its base model's names (`PeftModel.get_base_model()`), or None for a non-PEFT model.

    Raises CFPError for adapter types other than LoRA (naming the type), for LoRA variants (DoRA...), for LoRA
    on layers other than `Linear`, for adapters merged into the base weights, and for sharded LoRA factors
    (FSDP1 at all, FSDP2 / ZeRO-3 in `_adapted`).
    """
    peft_model = find_peft_model(model)
    if peft_model is None:
        return None
    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise CFPError(
            "CFP does not support a PeftModel under FSDP1 (FullyShardedDataParallel): it shards the LoRA factors "
            "into flat parameters, and CFP measures and corrects an adapted weight from its whole factors B and A. "
            "Train the LoRA model with DDP (its factors are small enough to replicate), or merge the adapter "
            "(merge_and_unload()) and train the full model under FSDP."
        )
    from peft import PeftType  # optional (the `peft` extra): imported already, as `peft_model` is a PeftModel

    for adapter in peft_model.active_adapters:
        peft_type = peft_model.peft_config[adapter].peft_type
        if peft_type != PeftType.LORA:
            kind = getattr(peft_type, "value", peft_type)
            raise CFPError(
                f"CFP supports LoRA adapters only; adapter {adapter!r} is of type {kind}. Merge it "
                "(merge_and_unload()) and train the full model, or use a LoRA adapter."
            )
    view = PeftView({}, {}, {})
    _walk(peft_model.get_base_model(), "", view, set())
    return view


def _walk(module: torch.nn.Module, prefix: str, view: PeftView, seen: set[int]) -> None:
    """Fill `view` with the parameters of `module` (named under `prefix`), tied parameters once."""

    def add(name: str, base: torch.Tensor, standing: torch.Tensor) -> None:
        if id(base) not in seen:
            seen.add(id(base))
            view.base[name], view.params[name] = base, standing

    lora_layer, modules_to_save, tuner_layer, auxiliary = _peft_classes()
    if isinstance(module, lora_layer):
        adapted = _adapted(module, prefix)
        for name, param in module.get_base_layer().named_parameters():
            add(prefix + name, param, param)
        if adapted is not None:
            view.adapted[adapted.name] = adapted
        return
    if isinstance(module, modules_to_save):
        (active,) = module.active_adapters  # PEFT trains one modules_to_save copy at a time
        trained = dict(module.modules_to_save[active].named_parameters())
        for name, param in module.original_module.named_parameters():
            add(prefix + name, param, trained[name])
        return
    if isinstance(module, (tuner_layer, auxiliary)):
        raise CFPError(
            f"CFP supports LoRA adapters only; module {prefix.rstrip('.')!r} is a {type(module).__name__}. Merge "
            "the adapter (merge_and_unload()) and train the full model, or use a LoRA adapter."
        )
    for name, param in module.named_parameters(recurse=False):
        add(prefix + name, param, param)
    for name, child in module.named_children():
        _walk(child, f"{prefix}{name}.", view, seen)


def _adapted(layer: "LoraLayer", prefix: str) -> AdaptedWeight | None:
    """The LoRA-adapted weight of `layer` (None when no active adapter sits on it), or CFPError if unsupported."""
    adapters = tuple(a for a in layer.active_adapters if a in layer.lora_A)
    name = prefix + "weight"
    if not adapters:
        return None
    what = None
    if any(layer.use_dora.get(a, False) for a in adapters):
        what = "uses DoRA (its magnitude vector rescales the merged weight)"
    elif any(getattr(layer, "lora_variant", {}).get(a) is not None for a in adapters):
        what = "uses a LoRA variant"
    elif not isinstance(layer, _supported_layers()):
        what = f"is a LoRA {type(layer).__name__} layer (only Linear, 4-bit and 8-bit Linear are supported)"
    elif layer.merged:
        what = "has its adapter merged into the base weight"
    elif layer.get_base_layer().weight.requires_grad:
        what = "trains its base weight as well as the adapter"
    elif any(
        isinstance(layer.lora_A[a].weight, DTensor) or hasattr(layer.lora_A[a].weight, "ds_id") for a in adapters
    ):
        what = "has sharded LoRA factors (FSDP / ZeRO-3)"
    if what is not None:
        raise CFPError(
            f"CFP cannot measure the LoRA-adapted weight {name!r}: it {what}. Supported: plain LoRA on Linear "
            "layers, full-precision or bitsandbytes 4-/8-bit (QLoRA), rsLoRA and PiSSA/OLoRA-style inits "
            "included, unmerged, not sharded."
        )
    return AdaptedWeight(name, layer, adapters)


def _supported_layers() -> tuple[type, ...]:
    """PEFT's LoRA `Linear`, and its bitsandbytes layers (QLoRA: `Linear4bit`, `Linear8bitLt`) once bitsandbytes
    is imported (a quantized model imports it; without it there is no such layer)."""
    from peft.tuners.lora import Linear as LoraLinear  # optional (the `peft` extra): a PeftModel exists here

    if sys.modules.get("bitsandbytes") is None:
        return (LoraLinear,)
    try:  # bitsandbytes is optional (the `qlora` extra); PEFT defines its LoRA layers only when it is installed
        from peft.tuners.lora.bnb import Linear4bit, Linear8bitLt
    except ImportError:
        return (LoraLinear,)
    return (LoraLinear, Linear4bit, Linear8bitLt)


def adapted_drift_sq(adapted: list[AdaptedWeight], views: list[DriftView]) -> torch.Tensor:
    """The drift sums of squares over the adapted weights' Delta_W, one weight at a time: float64 [1 + 2V] in the
    order of `ops.drift.drift_squares` (sum Delta_W^2, each weight once, then per view v sum F Delta_W^2 and the sum
    of Delta_W^2 where F <= threshold), `views[v].fishers[i]` anchor v's F on `adapted[i]` (or None).
    """
    sums = torch.zeros(1 + 2 * len(views), dtype=torch.float64)
    for i, weight in enumerate(adapted):
        sums += drift_squares([weight.displacement()], [None], [DriftView([v.fishers[i]], v.threshold) for v in views])
    return sums
