"""Streaming radix selection (hf_cfp/ops/order_statistics.py) against torch.kthvalue and a sort of the
concatenation, over many tensors (some empty), with ties, zeros, -0.0, negative and infinite values, one
element, bf16 and float32 inputs, and chunks smaller than the tensors (CHUNK patched to 5)."""

import math

import pytest
import torch

from hf_cfp.ops import free_threshold
from hf_cfp.ops import order_statistics as module
from hf_cfp.ops.order_statistics import float64_sum, order_statistics, rank_of_fraction, top_rank


@pytest.fixture(params=[module.CHUNK, 5], ids=["default-chunk", "chunk-5"])
def chunk(request, monkeypatch):
    monkeypatch.setattr(module, "CHUNK", request.param)
    return request.param


def split(flat, sizes, shapes=None):
    parts = list(flat.split(sizes))
    return [p.reshape(s) for p, s in zip(parts, shapes, strict=True)] if shapes else parts


def check_every_rank(tensors):
    """value(k) == kthvalue(cat, k) and tail_sum(k) == the float64 sum of the sorted tail, for every k."""
    flat = torch.cat([t.reshape(-1).float() for t in tensors])
    n = flat.numel()
    ordered = flat.sort().values.double()
    found = order_statistics(tensors, lambda count: range(1, count + 1))
    assert found.count == n
    assert found.total == pytest.approx(float(flat.double().sum()), rel=1e-12)
    for k, (value, tail) in enumerate(zip(found.values, found.tail_sums, strict=True), start=1):
        assert value == float(torch.kthvalue(flat, k).values), k
        assert tail == pytest.approx(float(ordered[k - 1 :].sum()), rel=1e-12, abs=1e-300), k


def test_random_values_in_many_tensors_and_shapes(chunk):
    generator = torch.Generator().manual_seed(0)
    sizes = [7, 0, 1, 12, 30, 3, 0, 24]
    flat = torch.rand(sum(sizes), generator=generator) * torch.logspace(-8, 3, sum(sizes))
    tensors = split(flat, sizes, [(7,), (0, 4), (1,), (3, 4), (2, 3, 5), (3,), (0,), (4, 6)])
    check_every_rank(tensors)


def test_ties_zeros_negative_zero_and_negative_values(chunk):
    values = torch.tensor([2.0, 0.0, -0.0, 2.0, 0.5, 0.0, 2.0, -1.5, 8.0, 2.0, -0.0, 0.5, -1.5, 2.0])
    check_every_rank(split(values, [5, 9]))


def test_values_sharing_their_high_bits_are_told_apart_by_the_low_bits(chunk):
    one = torch.tensor(1.0).view(torch.int32)
    close = (one + torch.tensor([9, 0, 3, 3, 65535, 1, 0, 2], dtype=torch.int32)).view(torch.float32)  # 1.0 + j ulp
    check_every_rank(split(close, [3, 5]))


def test_infinite_values_and_a_single_element(chunk):
    check_every_rank([torch.tensor([math.inf, 1.0, math.inf, 0.0])])
    check_every_rank([torch.tensor([[3.25]])])


def test_bf16_inputs_are_ranked_as_their_float32_values(chunk):
    generator = torch.Generator().manual_seed(1)
    values = (torch.rand(40, generator=generator) * 4).to(torch.bfloat16)  # many exact ties in bf16
    tensors = split(values, [10, 30])
    check_every_rank(tensors)
    assert free_threshold(tensors, 0.7) == float(torch.kthvalue(values.float(), 28).values)


def test_top_sums_count_exactly_m_tied_values():
    # sorted: 0, 1, 1, 1, 1, 3 (n = 6); the top 3 are 3 + 1 + 1 = 5, though four values tie at 1
    tensors = [torch.tensor([1.0, 0.0, 1.0]), torch.tensor([3.0, 1.0, 1.0])]
    found = order_statistics(tensors, lambda n: [top_rank(0.5, n), top_rank(0.01, n), 1])
    assert found.values == (1.0, 3.0, 0.0)
    assert found.tail_sums == (5.0, 3.0, 7.0)


def test_free_threshold_is_kthvalue_with_k_ceil_of_the_fraction():
    generator = torch.Generator().manual_seed(2)
    tensors = [torch.rand(s, generator=generator) for s in (101, 0, 57, 3)]
    flat = torch.cat(tensors)
    for fraction in (0.0, 0.01, 0.5, 0.99, 0.999, 1.0):
        k = max(1, math.ceil(fraction * flat.numel()))
        assert rank_of_fraction(fraction, flat.numel()) == k
        assert free_threshold(tensors, fraction) == float(torch.kthvalue(flat, k).values)


def test_a_rank_outside_the_values_is_refused():
    with pytest.raises(ValueError, match="within 1..3"):
        order_statistics([torch.ones(3)], lambda n: [n + 1])
    with pytest.raises(ValueError, match="within 1..0"):
        free_threshold([torch.ones(0)], 0.5)


def test_float64_sum_adds_every_element_without_float32_rounding(chunk):
    tensors = [torch.full((9,), 2.0**24), torch.ones(7, dtype=torch.bfloat16)]
    assert float64_sum(tensors) == 9 * 2.0**24 + 7  # float32 accumulation would drop the ones
