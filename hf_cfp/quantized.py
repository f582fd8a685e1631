"""Weights stored quantized by bitsandbytes (QLoRA bases): their format and logical shape.

A 4-bit weight (`bitsandbytes.nn.Params4bit`, NF4 or FP4) stores two values per byte in a tensor whose
`.shape` is the packed storage's, e.g. (numel / 2, 1) as uint8; its logical shape is `quant_state.shape`. An
8-bit weight (`Int8Params`) keeps its logical shape, as int8 with a separate scale. Neither holds the
full-precision values any more, so only names and logical shapes can be compared with a full-precision model.
"""

import sys

import torch


def quantization(tensor: torch.Tensor) -> tuple[str, torch.Size] | None:
    """(format, logical shape) of a bitsandbytes-quantized weight: ("bnb-nf4" / "bnb-fp4" / "bnb-int8", shape);
    None for any other tensor, and for a bitsandbytes parameter not quantized yet.

    bitsandbytes is not imported here (it is optional, and slow to import): a quantized tensor exists only
    once bitsandbytes has been imported, so without it in `sys.modules` there is none.
    """
    bnb = sys.modules.get("bitsandbytes")
    if bnb is None:
        return None
    if isinstance(tensor, bnb.nn.Params4bit) and tensor.quant_state is not None:
        return f"bnb-{tensor.quant_state.quant_type}", torch.Size(tensor.quant_state.shape)
    if isinstance(tensor, bnb.nn.Int8Params) and tensor.dtype == torch.int8:
        return "bnb-int8", tensor.shape
    return None


def logical_shape(tensor: torch.Tensor) -> torch.Size:
    """The shape of the weight `tensor` stands for: its own, or a quantized weight's logical shape."""
    quantized = quantization(tensor)
    return tensor.shape if quantized is None else quantized[1]
