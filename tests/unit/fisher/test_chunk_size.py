"""The default chunk size of the batched engine, against its formula on a stubbed available memory."""

import os

import pytest
import torch

from hf_cfp.fisher import chunk_size


@pytest.mark.parametrize(
    ("available", "want"),
    [
        (24 * 2**30, 2**26),  # plenty: capped at 2^26 elements (256 MB)
        (4 * 2**30, 4 * 2**30 // 128),  # 33.5M elements: two float32 buffers = 256 MB = 1/16 of 4 GB
        (100, 0),  # nothing left: accumulate still takes one sequence per chunk
    ],
)
def test_default_chunk_is_a_sixteenth_of_available_memory_in_two_float32_buffers(monkeypatch, available, want):
    monkeypatch.setattr(chunk_size, "available_bytes", lambda device: available)
    got = chunk_size.default_chunk_elements(torch.device("cpu"))
    assert got == want
    assert 2 * 4 * got <= available / 16


@pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="Linux only")
def test_available_bytes_on_cpu_is_mem_available():
    """psutil's `available` is /proc/meminfo's MemAvailable on Linux (the two reads are a moment apart)."""
    with open("/proc/meminfo") as handle:
        fields = dict(line.split(":", 1) for line in handle)
    mem_available = int(fields["MemAvailable"].split()[0]) * 1024
    assert abs(chunk_size.available_bytes(torch.device("cpu")) - mem_available) < 256 * 2**20
