"""Exact order statistics of values spread over many tensors, in bounded memory (streaming radix selection).

For n values x_1..x_n (every element of every tensor, taken as float32) and a rank k in 1..n:

    value(k)     the k-th smallest x (as `torch.kthvalue` of the concatenation gives it),
    tail_sum(k)  the sum of the values of ranks k..n, i.e. of the n - k + 1 largest; when several values
                 tie with value(k), exactly as many of them are counted as the ranks k..n hold.

The top-m sum is tail_sum(n - m + 1). Nothing is concatenated and no tensor is copied whole:

- Every float32 x maps to an integer key whose order is the order of the values: with b the int32 bit
  pattern of x, key = (b XOR ((b >> 31) AND 0x7FFFFFFF)) + 2^31, in [0, 2^32). A non-negative float's
  bits already order like integers; a negative one's magnitude bits are flipped. -0.0 is made +0.0 first,
  so that it ties with 0 as in torch. (NaN has no rank: inputs must have none.)
- Pass 1 counts the keys by their high 16 bits in 65536 buckets, and sums the values per bucket (float64).
  The bucket where the running count reaches k holds value(k).
- Pass 2 counts (and sums) the low 16 bits of the keys in that bucket only: the full key, hence value(k),
  is then known exactly, with the number of values above it and their sum.

Each pass visits the tensors one at a time, CHUNK elements at a time (the tensors are iterated twice, so a
lazily read collection is read twice), so the extra memory is a few chunk-sized temporaries whatever n is;
only scalar and per-bucket accumulators are float64.
"""

import math
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass

import torch

CHUNK = 1 << 18  # elements per step of a pass: about 10 MB of temporaries
_BITS = 16
_BUCKETS = 1 << _BITS


@dataclass(frozen=True)
class Ranked:
    """What `order_statistics` found: n, the sum of all values, and per requested rank k value(k) and
    tail_sum(k) (the sum of the n - k + 1 largest values, ties counted exactly)."""

    count: int
    total: float
    values: tuple[float, ...]
    tail_sums: tuple[float, ...]


def rank_of_fraction(fraction: float, n: int) -> int:
    """k = max(1, ceil(fraction * n)): the rank at or below which `fraction` of n values lie."""
    return max(1, math.ceil(fraction * n))


def top_rank(fraction: float, n: int) -> int:
    """n - m + 1 with m = max(1, ceil(fraction * n)): tail_sum of this rank is the sum of the top m values."""
    return n - rank_of_fraction(fraction, n) + 1


def _chunks(tensors: Collection[torch.Tensor]) -> Iterator[torch.Tensor]:
    """The tensors' elements as flat float32 chunks of at most CHUNK elements, -0.0 made +0.0, one tensor at a
    time (a contiguous tensor is sliced in place; each chunk is a fresh float32 copy of CHUNK elements)."""
    for tensor in tensors:
        flat = tensor.detach().reshape(-1)
        for start in range(0, flat.numel(), CHUNK):
            yield flat[start : start + CHUNK].float() + 0.0


def float64_sum(tensors: Collection[torch.Tensor]) -> float:
    """sum_i x_i over every element, accumulated in float64 chunk by chunk (no float64 copy of a tensor)."""
    return sum(float(chunk.sum(dtype=torch.float64)) for chunk in _chunks(tensors))


def _keys(values: torch.Tensor) -> torch.Tensor:
    """int64 keys in [0, 2^32) ordered as the float32 `values` (no -0.0, no NaN)."""
    bits = values.view(torch.int32)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).long() + (1 << 31)


def _value(key: int) -> float:
    """The float32 value of a key of `_keys` (the map is its own inverse on the bit pattern)."""
    bits = torch.tensor(key - (1 << 31), dtype=torch.int32)
    return float((bits ^ ((bits >> 31) & 0x7FFFFFFF)).view(torch.float32))


def _histogram(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count, float64 sum of `values`) per key in [0, 2^16), on the CPU."""
    counts = torch.bincount(keys, minlength=_BUCKETS)
    sums = torch.bincount(keys, weights=values.double(), minlength=_BUCKETS)
    return counts.cpu(), sums.cpu()


def _locate(counts: torch.Tensor, k: int) -> tuple[int, int]:
    """(the bucket holding the k-th smallest counted key, how many keys lie in the buckets below it)."""
    cumulative = counts.cumsum(0)
    bucket = int(torch.searchsorted(cumulative, k))
    return bucket, int(cumulative[bucket - 1]) if bucket else 0


def order_statistics(tensors: Collection[torch.Tensor], ranks: Callable[[int], Sequence[int]]) -> Ranked:
    """value(k) and tail_sum(k) (module docstring) for each rank k in `ranks(n)`, n the number of values,
    by two streaming passes over `tensors`. Raises ValueError for a rank outside 1..n."""
    high_counts = torch.zeros(_BUCKETS, dtype=torch.int64)
    high_sums = torch.zeros(_BUCKETS, dtype=torch.float64)
    for chunk in _chunks(tensors):
        counts, sums = _histogram(_keys(chunk) >> _BITS, chunk)
        high_counts += counts
        high_sums += sums
    n = int(high_counts.sum())
    wanted = list(ranks(n))
    if any(not 1 <= k <= n for k in wanted):
        raise ValueError(f"ranks {wanted} are not all within 1..{n} (the number of values)")
    located = [_locate(high_counts, k) for k in wanted]
    low = {
        bucket: (torch.zeros(_BUCKETS, dtype=torch.int64), torch.zeros(_BUCKETS, dtype=torch.float64))
        for bucket, _ in located
    }
    for chunk in _chunks(tensors) if low else ():
        keys = _keys(chunk)
        high = keys >> _BITS
        for bucket, (low_counts, low_sums) in low.items():
            inside = high == bucket
            counts, sums = _histogram(keys[inside] & (_BUCKETS - 1), chunk[inside])
            low_counts += counts
            low_sums += sums
    values, tails = [], []
    for k, (bucket, below) in zip(wanted, located, strict=True):
        low_counts, low_sums = low[bucket]
        offset, below_low = _locate(low_counts, k - below)
        value = _value((bucket << _BITS) | offset)
        above = n - below - below_low - int(low_counts[offset])  # values greater than value(k)
        above_sum = float(high_sums[bucket + 1 :].sum()) + float(low_sums[offset + 1 :].sum())
        values.append(value)
        tails.append(above_sum + (n - k + 1 - above) * value)
    return Ranked(n, float(high_sums.sum()), tuple(values), tuple(tails))


def top_mask(tensors: Sequence[torch.Tensor], fraction: float) -> torch.Tensor:
    """T(F): a flat boolean mask of the k = ceil(fraction * n) largest coordinates of the tensors taken in
    order and flattened; ties at the k-th largest value are broken by the lower flat index. The k-th largest
    is selected by streaming (`ops.order_statistics`); the tensors are never concatenated, only the mask is
    built (n bytes)."""
    kth = order_statistics(tensors, lambda n: [top_rank(fraction, n)]).values[0]
    flats = [t.detach().reshape(-1) for t in tensors]
    mask = torch.empty(sum(f.numel() for f in flats), dtype=torch.bool, device=flats[0].device)
    for flat, part in zip(flats, mask.split([f.numel() for f in flats]), strict=True):
        torch.gt(flat, kth, out=part)
    need = rank_of_fraction(fraction, mask.numel()) - int(mask.sum())  # ties at kth to take, lowest index first
    for flat, part in zip(flats, mask.split([f.numel() for f in flats]), strict=True):
        tied = (flat == kth).nonzero().squeeze(1)[:need]
        part[tied] = True
        need -= tied.numel()
    return mask


def top_overlap(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], fraction: float) -> float:
    """|T(a) ∩ T(b)| / |T|, T the top ceil(fraction * n) coordinate set of `top_mask`."""
    mask_a = top_mask(a, fraction)
    mask_b = top_mask(b, fraction).to(mask_a.device)
    return int((mask_a & mask_b).sum()) / int(mask_a.sum())
