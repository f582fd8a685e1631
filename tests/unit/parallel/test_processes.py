"""The collective helpers: one device per all-reduce (checked without a GPU), the backend's devices, dtype buckets.

A second process is stood in for where a test needs one: `process_rank_and_count` says (0, 2), the backend is
named, and `dist.all_reduce` doubles its bucket (the sum over two processes that hold the same values) and records
it. The real collectives run in the multi-process tests (tests/integration/test_multiprocess.py,
test_kfac_distributed.py, test_distributed.py), through the same checks.
"""

import pytest
import torch

import hf_cfp.parallel.processes as processes
from hf_cfp.errors import CFPError, CollectiveDeviceError
from hf_cfp.parallel import all_reduce_sum_, collective_device
from hf_cfp.parallel.processes import reducible_device_types


def two_processes(monkeypatch, backend: str) -> list[tuple[torch.dtype, int]]:
    """This process as rank 0 of 2 under `backend`; returns the (dtype, elements) of every all-reduce."""
    calls: list[tuple[torch.dtype, int]] = []

    def all_reduce(flat: torch.Tensor) -> None:
        calls.append((flat.dtype, flat.numel()))
        flat.mul_(2)

    monkeypatch.setattr(processes, "process_rank_and_count", lambda: (0, 2))
    monkeypatch.setattr(processes.dist, "get_backend", lambda: backend)
    monkeypatch.setattr(processes.dist, "all_reduce", all_reduce)
    return calls


def test_tensors_on_two_devices_are_refused_on_one_process_and_left_unchanged():
    counter, sums = torch.tensor([3.0], dtype=torch.float64), torch.zeros(4, device="meta")
    with pytest.raises(CollectiveDeviceError, match=r"2 devices \(meta, cpu\).*once per device") as info:
        all_reduce_sum_([sums, counter])
    assert isinstance(info.value, CFPError) and isinstance(info.value, RuntimeError)
    assert counter.item() == 3.0


def test_tensors_on_two_devices_are_refused_before_any_collective(monkeypatch):
    calls = two_processes(monkeypatch, "gloo")
    with pytest.raises(CollectiveDeviceError, match="meta"):
        all_reduce_sum_([torch.ones(2), torch.ones(2, device="meta")])
    assert calls == []


def test_a_device_the_backend_cannot_reduce_is_refused_before_any_collective(monkeypatch):
    calls = two_processes(monkeypatch, "nccl")
    monkeypatch.setenv("LOCAL_RANK", "1")
    counter = torch.tensor([5.0], dtype=torch.float64)
    with pytest.raises(CollectiveDeviceError, match=r"on cpu.*'nccl'.*\['cuda'\].*collective_device\(\) \(cuda:1"):
        all_reduce_sum_([counter])
    assert calls == [] and counter.item() == 5.0


def test_reducible_device_types_are_torchs_backend_capabilities():
    assert reducible_device_types("nccl") == {"cuda"}
    assert reducible_device_types("gloo") == {"cpu", "cuda"}
    assert reducible_device_types("xccl") == {"xpu"}
    assert reducible_device_types("cuda:nccl,cpu:gloo") == {"cpu", "cuda"}  # accelerate's FSDP with offloading
    assert reducible_device_types("cuda:nccl") == {"cuda"}
    assert reducible_device_types("custom_backend") == {"cpu", "cuda"}  # what torch assumes for a name it lacks


@pytest.mark.parametrize(
    "backend, local_rank, expected",
    [("gloo", "1", "cpu"), ("cuda:nccl,cpu:gloo", "1", "cpu"), ("nccl", "1", "cuda:1"), ("nccl", "5", "cuda:1")],
)
def test_collective_device_follows_the_backend_and_the_local_rank(monkeypatch, backend, local_rank, expected):
    assert collective_device() == torch.device("cpu")  # no process group
    two_processes(monkeypatch, backend)
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)  # local rank 5 of a node with 4 GPUs: cuda:1
    assert collective_device() == torch.device(expected)


def test_each_dtype_is_reduced_in_its_own_buckets_without_promotion(monkeypatch):
    calls = two_processes(monkeypatch, "gloo")
    generator = torch.Generator().manual_seed(0)
    tensors = [
        torch.rand(5, generator=generator),
        torch.full((3,), 1 + 2**-40, dtype=torch.float64),  # 1 + 2^-40 is not a float32: kept only in float64
        torch.rand(2, 4, generator=generator),  # 8 elements, over the bucket: alone
        torch.rand(2, generator=generator).bfloat16(),
        torch.rand(4, generator=generator),
        torch.tensor([7.0], dtype=torch.float64),
    ]
    expected = [2 * t for t in tensors]
    all_reduce_sum_(tensors, bucket_elements=6)
    f32, f64, bf16 = torch.float32, torch.float64, torch.bfloat16
    assert calls == [(f32, 5), (f32, 8), (f32, 4), (f64, 4), (bf16, 2)]
    for got, want in zip(tensors, expected, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert tensors[1][0].item() == 2 + 2**-39


def test_one_process_and_no_tensors_reduce_nothing():
    tensors = [torch.ones(3)]
    all_reduce_sum_(tensors)
    all_reduce_sum_([])
    assert torch.equal(tensors[0], torch.ones(3))
