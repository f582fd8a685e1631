"""Fused kernels for the per-step operations: each reads its inputs once and writes at most once, with no
temporary in memory (`torch.compile`: vectorized C++ on a CPU, Triton on a GPU), so a step moves only the bytes
its formula needs. For a tensor covered by one anchor (F, lam), with theta0 and the parameter:

    pull      theta <- theta0 + (theta - theta0) / (1 + lam F)                                  (in place)
    drift     [sum D^2, sum F D^2, sum over F <= threshold of D^2],  D = theta - theta0
    square    [sum D^2]                                              (a tensor no diagonal anchor covers)
    budget    [0.5 sum F D^2 / (1 + lam F)^2,  - sum F^2 D^2 / (1 + lam F)^3]

computed in float32, summed in float32 blocks whose sums add in float64 (`_sums`; the chunked pack path sums
each chunk in float64), a pulled value rounded once to the parameter's dtype. One call per tensor (each costs
about 15 us of guards beside its work, so tensors below `MIN_ELEMENTS` are left to the pack path, which takes
many small ones in one pass); the lam and the threshold enter as tensors, so a new value is no new compilation.

`available()` says whether the kernels may run: not with `HF_CFP_COMPILE=0` in the environment, and not after a
compilation failed once in this process (no C++ compiler, an unsupported device: logged once); callers then use
the pack path, which also serves what the kernels do not cover (several anchors on one tensor, theta0 or F kept
on another device, small tensors).
"""

import os
from collections.abc import Callable, Sequence

import torch
from transformers.utils import logging

logger = logging.get_logger(__name__)

MIN_ELEMENTS = 1 << 16  # smaller tensors (norms, biases) go to the pack path
_STATE = {"failed": False}
_KERNELS: dict[str, Callable] = {}  # compiled on first use (importing torch.compile's machinery costs time)


def available() -> bool:
    """Whether the fused kernels may be used (see the module docstring)."""
    return os.environ.get("HF_CFP_COMPILE", "1") != "0" and not _STATE["failed"]


BLOCK = 1024  # elements summed in float32 before the float64 sum (see `_sums`)


def _sums(terms: Callable, *tensors: torch.Tensor) -> torch.Tensor:
    """float64 [sum over the elements of each float32 term of `terms(*tensors)`]: the elements in blocks of
    `BLOCK` summed in float32, the block sums (and the last, partial block) in float64. Each term is of one sign,
    so a block sum's relative error is at most about BLOCK / 16 * 2^-24 (vectorized 16 lanes wide), 4e-6, and the
    float64 sum adds none that matters; an all-float64 reduction costs three times as long on a CPU."""
    whole = tensors[0].numel() // BLOCK * BLOCK
    blocks = terms(*(t[:whole].view(-1, BLOCK) for t in tensors))
    rest = terms(*(t[whole:] for t in tensors))
    return torch.stack([b.sum(1).double().sum() + r.double().sum() for b, r in zip(blocks, rest, strict=True)])


def _pull(param, theta0, fisher, lam):
    start = theta0.float()
    param.copy_(start + (param.float() - start) / (fisher.float() * lam + 1.0))


def _drift(param, theta0, fisher, threshold):
    def terms(p, t, f):
        square, f = (p.float() - t.float()).square(), f.float()
        return square, square * f, torch.where(f <= threshold, square, torch.zeros_like(square))

    return _sums(terms, param, theta0, fisher)


def _square(param, theta0):
    return _sums(lambda p, t: [(p.float() - t.float()).square()], param, theta0)


def _budget(param, theta0, fisher, lam):
    def terms(p, t, f):
        f = f.float()
        relief = f * lam + 1.0
        weighted = f * ((p.float() - t.float()) / relief).square()  # F D^2 / (1 + lam F)^2
        return 0.5 * weighted, -(weighted * f / relief)

    return _sums(terms, param, theta0, fisher)


_FUNCTIONS: dict[str, Callable] = {"pull": _pull, "drift": _drift, "square": _square, "budget": _budget}


def run(kernel: str, columns: Sequence[Sequence[torch.Tensor]], scalar: float | None = None):
    """`kernel` over the tensors of `columns` (parallel lists: parameters, theta0, then F where the kernel takes
    one; 1-D, on one device), with the lam or threshold `scalar`: None for "pull", the stacked per-tensor sums
    (float64, on the device, one row per tensor) for the others; False when the kernels cannot run here (the
    caller falls back to the pack path), which a failed compilation also makes true for the rest of the process."""
    if not available():
        return False
    device = columns[0][0].device
    extra = () if scalar is None else (torch.tensor(float(scalar), dtype=torch.float32, device=device),)
    try:
        if kernel not in _KERNELS:
            _KERNELS[kernel] = torch.compile(_FUNCTIONS[kernel], dynamic=True)
        compiled = _KERNELS[kernel]
        results = [compiled(*tensors, *extra) for tensors in zip(*columns, strict=True)]
    except Exception as error:  # a compiler or device the kernels cannot use: fall back, and say so once
        _STATE["failed"] = True
        logger.warning(
            "hf-cfp's fused kernels could not be compiled here (%s: %s); the chunked path is used instead "
            "(correct, slower). Set HF_CFP_COMPILE=0 to skip the attempt.",
            type(error).__name__,
            str(error).splitlines()[0] if str(error) else "",
        )
        return False
    return None if kernel == "pull" else torch.stack(results)
