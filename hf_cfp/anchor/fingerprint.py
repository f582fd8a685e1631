"""Bind an anchor to the base model it was computed for: a fingerprint of names, shapes, dtypes and bytes.

The fingerprint is small JSON stored in the anchor's metadata. It does not prove two models equal; it
catches the usual accidents (another model, another size, another checkpoint, another dtype) cheaply.

A base quantized by bitsandbytes (QLoRA: 4-bit NF4/FP4 or 8-bit weights, `hf_cfp.quantized`) against an
anchor estimated on the full-precision base: a quantized weight is listed as `bnb-nf4[out,in]` (its format and
logical shape, not its packed storage) and compared by name and logical shape only. Its dtype (the anchor's
base had float32 or bfloat16 there) and its values (rounded to 4 or 8 bits, packed) cannot be compared, so a
sampled tensor that is quantized here is not hashed. The weights left unquantized (embeddings, norms,
`lm_head` by default) are compared as on any model: dtype, shape, and the first 1 MiB when sampled.
"""

import hashlib
import math

import torch
from torch.distributed.tensor import DTensor
from transformers.utils import logging

from ..errors import AnchorMismatchError, plural
from ..names import named_parameters_once
from ..parallel.processes import log_on_main_process
from ..parallel.shards import held_pieces
from ..quantized import logical_shape, quantization

logger = logging.get_logger(__name__)

FINGERPRINT_VERSION = 1
SAMPLE_BYTES = 1 << 20  # bytes hashed per sampled tensor
MAX_LISTED = 4096  # parameters listed by name in the fingerprint; larger models keep only the hashes


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _signature(tensor: torch.Tensor) -> str:
    """`"float32[32,16]"`: dtype and shape of one parameter; `"bnb-nf4[32,16]"`: format and logical shape of a
    quantized one."""
    quantized = quantization(tensor)
    kind, shape = quantized if quantized is not None else (_dtype(tensor), tensor.shape)
    return f"{kind}[{','.join(map(str, shape))}]"


def _comparable(stored: str, live: str) -> bool:
    """Whether two signatures may describe the same weight: equal, or, where either side is quantized
    (`bnb-...`: its dtype is gone), the same logical shape."""
    if stored == live:
        return True
    quantized = stored.startswith("bnb-") or live.startswith("bnb-")
    return quantized and stored[stored.find("[") :] == live[live.find("[") :]


def _numel(tensor: torch.Tensor) -> int:
    """Number of elements of the weight `tensor` stands for (a quantized one's logical numel)."""
    return math.prod(logical_shape(tensor))


def _parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Canonical name -> parameter, all of them (frozen included), tied aliases once. A parameter of
    which this process holds a flat piece only (FSDP1, ZeRO-3; `parallel.shards.held_pieces`) is
    replaced by a meta tensor of its full shape: listed, not sampled."""
    flat_views, pieces = held_pieces(model)
    params: dict[str, torch.Tensor] = {
        name: p for name, p in named_parameters_once(model, trainable_only=False) if not name.endswith("_flat_param")
    }
    params.update(flat_views)
    return {
        name: torch.empty(pieces[id(p)].shape, dtype=p.dtype, device="meta") if id(p) in pieces else p
        for name, p in params.items()
    }


def _tensor_sha256(name: str, tensor: torch.Tensor) -> str | None:
    """sha256 of `name|dtype[shape]|` and the first SAMPLE_BYTES bytes of the tensor as stored (on CPU).
    None for a tensor without data (meta device) or sharded across processes (a DTensor: each
    process holds other bytes, and gathering them would be a collective)."""
    if tensor.device.type == "meta" or isinstance(tensor, DTensor):
        return None
    count = min(tensor.numel(), math.ceil(SAMPLE_BYTES / max(1, tensor.element_size())))
    head = tensor.detach().reshape(-1)[:count].cpu().contiguous().view(torch.uint8)[:SAMPLE_BYTES]
    digest = hashlib.sha256(f"{name}|{_signature(tensor)}|".encode())
    digest.update(head.numpy().tobytes())
    return digest.hexdigest()


def _structure_sha256(listing: dict[str, str]) -> str:
    return hashlib.sha256("".join(f"{n}\t{s}\n" for n, s in sorted(listing.items())).encode()).hexdigest()


def _combined(digests: dict[str, str | None]) -> str:
    return hashlib.sha256("\n".join(f"{n}\t{d}" for n, d in digests.items()).encode()).hexdigest()


def model_fingerprint(model: torch.nn.Module) -> dict:
    """A fingerprint of `model`'s parameters (canonical names, so wrappers such as DDP's `module.` or
    torch.compile's `_orig_mod.` do not change it; tied parameters count once):

    - `num_parameters`: sum of numel over all parameters, frozen ones included (logical numel if quantized);
    - `parameters_sha256`: sha256 of the sorted lines `name<TAB>dtype[shape]` (`bnb-nf4[shape]` if quantized);
    - `parameters`: {name: "dtype[shape]"} (None above MAX_LISTED parameters), to say what differs;
    - `sampled_parameters`: the first, middle and last names in sorted order;
    - `sampled_sha256`: {name: sha256 of `name|dtype[shape]|` + the tensor's first 1 MiB as stored};
    - `weights_sha256`: sha256 over the sampled names and their digests.
    """
    params = _parameters(model)
    names = sorted(params)
    listing = {name: _signature(params[name]) for name in names}
    sampled = list(dict.fromkeys(names[i] for i in (0, len(names) // 2, len(names) - 1))) if names else []
    digests = {name: _tensor_sha256(name, params[name]) for name in sampled}
    return {
        "fingerprint_version": FINGERPRINT_VERSION,
        "num_parameters": sum(_numel(p) for p in params.values()),
        "parameters_sha256": _structure_sha256(listing),
        "parameters": listing if len(listing) <= MAX_LISTED else None,
        "sampled_parameters": sampled,
        "sampled_sha256": digests,
        "weights_sha256": _combined(digests),
    }


def _few(names) -> str:
    names = sorted(names)
    return ", ".join(map(repr, names[:3])) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _are(names) -> str:
    return "is" if len(names) == 1 else "are"


def _differences(expected: dict, params: dict[str, torch.Tensor]) -> list[str]:
    """What differs between a stored fingerprint and the live parameters, as short phrases: the count, then
    the names, shapes and dtypes, then the sampled weights."""
    listing = {name: _signature(params[name]) for name in sorted(params)}
    return [
        *_count_difference(expected, params),
        *_structure_differences(expected, params, listing),
        *_weight_differences(expected, params, listing),
    ]


def _count_difference(expected: dict, params: dict[str, torch.Tensor]) -> list[str]:
    live_count = sum(_numel(p) for p in params.values())
    if expected.get("num_parameters") is not None and expected["num_parameters"] != live_count:
        return [f"parameter count {expected['num_parameters']} (anchor's base model) vs {live_count} (this model)"]
    return []


def _structure_differences(expected: dict, params: dict[str, torch.Tensor], listing: dict[str, str]) -> list[str]:
    """Names missing or extra, and up to three parameters of another dtype or shape, against the stored listing;
    without one (a base over MAX_LISTED parameters), against its hash (not for a quantized model)."""
    stored = expected.get("parameters")
    if isinstance(stored, dict):
        problems = []
        missing, extra = stored.keys() - listing.keys(), listing.keys() - stored.keys()
        changed = [n for n in stored.keys() & listing.keys() if not _comparable(stored[n], listing[n])]
        if missing:
            problems.append(
                f"{plural(len(missing), 'parameter')} of the anchor's base model {_are(missing)} missing here: "
                f"{_few(missing)}"
            )
        if extra:
            problems.append(
                f"{plural(len(extra), 'parameter')} here {_are(extra)} not in the anchor's base model: {_few(extra)}"
            )
        for name in sorted(changed)[:3]:
            problems.append(f"{name!r} is {stored[name]} in the anchor's base model but {listing[name]} here")
        if len(changed) > 3:
            problems.append(
                f"{plural(len(changed) - 3, 'more parameter')} {_are(changed[3:])} of another dtype or shape"
            )
        return problems
    if any(quantization(p) is not None for p in params.values()):
        # only a hash of `name<TAB>dtype[shape]` lines is stored, and the dtypes of quantized weights are gone
        log_on_main_process(
            logger.warning_once,
            "The anchor's fingerprint lists no parameters (its base has over %d): names and shapes of this "
            "quantized model cannot be compared with it, only the parameter count.",
            MAX_LISTED,
        )
    elif expected.get("parameters_sha256") not in (None, _structure_sha256(listing)):
        return ["parameter names, shapes or dtypes differ (parameters_sha256)"]
    return []


def _weight_differences(expected: dict, params: dict[str, torch.Tensor], listing: dict[str, str]) -> list[str]:
    """The sampled tensors whose leading bytes hash differently, among those of the same name, shape and dtype
    (quantized weights are not compared)."""
    stored = expected.get("parameters")
    differing = []
    for name, digest in (expected.get("sampled_sha256") or {}).items():
        if name in params and digest is not None and quantization(params[name]) is None:
            live = _tensor_sha256(name, params[name])
            if (
                live is not None
                and live != digest
                and (not isinstance(stored, dict) or stored.get(name) == listing[name])
            ):
                differing.append(name)
    if not differing:
        return []
    return [
        f"same names and shapes but different weights: sampled {'tensor' if len(differing) == 1 else 'tensors'} "
        f"{_few(differing)} {'differs' if len(differing) == 1 else 'differ'}"
    ]


def check_fingerprint(
    expected: dict | None,
    model: torch.nn.Module,
    anchor_name: str,
    strict: bool = True,
    parameters: dict[str, torch.Tensor] | None = None,
) -> None:
    """Check that `model` is the base model whose fingerprint (`model_fingerprint`) is `expected`.

    `parameters` (name -> tensor) replaces `model`'s own named parameters when the base model sits behind
    other names: a PeftModel's base weights under the base model's names (`protection.peft_adapters`).

    Compares the parameter count, the names/dtypes/shapes and the first 1 MiB of the sampled tensors.
    A weight quantized by bitsandbytes here (a QLoRA base) is compared by name and logical shape only: its
    dtype and values are not those of the full-precision base the anchor was computed on (module docstring).
    On a difference raise AnchorMismatchError saying what differs and what to do; with strict=False
    log a warning instead. An empty or None `expected` (anchors saved before fingerprints) passes.
    """
    if not expected:
        return
    problems = _differences(expected, _parameters(model) if parameters is None else parameters)
    if not problems:
        return
    message = (
        f"Anchor {anchor_name!r} was computed for another base model: " + "; ".join(problems) + ". "
        "Use the base model the anchor was computed for (same checkpoint and torch_dtype; its metadata names "
        "it), re-estimate the anchor for this model with estimate_fisher(), or pass strict=False to use it anyway."
    )
    if strict:
        raise AnchorMismatchError(message)
    log_on_main_process(logger.warning_once, message)
