"""Peak resident memory of a call, read from Linux's /proc/self (tracemalloc does not see torch's allocations)."""

import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

import torch

from hf_cfp.anchor.statistics import fisher_statistics

T = TypeVar("T")


def _status_bytes(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB$", Path("/proc/self/status").read_text(), re.MULTILINE)
    if match is None:
        raise OSError(f"/proc/self/status has no {field} line: peak memory is measured on Linux only.")
    return int(match.group(1)) * 1024


def peak_rss_increase(call: Callable[[], T]) -> tuple[T, int]:
    """(call(), VmHWM_after - VmRSS_before): how many bytes the process's peak resident set rose above its
    resident set at the start of the call. The peak (VmHWM) is first reset to the current resident set by
    writing 5 to /proc/self/clear_refs (Linux >= 4.0). Memory the process freed earlier but kept (allocator
    caches) can be reused without showing, so measure in a fresh process for an upper figure."""
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_bytes("VmRSS")
    result = call()
    return result, _status_bytes("VmHWM") - before


def statistics_peak_vs_anchor(fisher: Mapping[str, torch.Tensor]) -> float:
    """(A + P) / A for A = the bytes of the tensors of `fisher` (numel x element size, already resident) and
    P = the rise of the process's peak resident set while `fisher_statistics(fisher)` runs
    (`peak_rss_increase`): the statistics' peak memory in units of the anchor's own size.
    Call it in a fresh process that holds the anchor and little else (Linux)."""
    size = sum(t.numel() * t.element_size() for t in fisher.values())
    _, peak = peak_rss_increase(lambda: fisher_statistics(fisher))
    return (size + max(peak, 0)) / size
