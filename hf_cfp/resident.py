"""Peak resident memory of a call, read from Linux's /proc/self (tracemalloc does not see torch's allocations)."""

import re
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

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
