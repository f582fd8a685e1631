"""benchkit.resident: the rise of the peak resident set during a call, against the bytes the call touched."""

import sys

import pytest
import torch
from benchkit.resident import peak_rss_increase

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc/self")


def test_the_peak_rise_counts_a_buffer_the_call_fills_and_frees():
    size = 64 * 2**20  # 64 MB, written so that every page is resident

    def fill() -> int:
        buffer = torch.ones(size, dtype=torch.uint8)
        return int(buffer[::4096].sum())

    pages, peak = peak_rss_increase(fill)
    assert pages == size // 4096  # the call's own result comes back
    assert size <= peak < 2 * size  # the buffer, not much more (it is freed before the peak is read)


def test_a_call_that_allocates_nothing_raises_the_peak_by_little():
    _, peak = peak_rss_increase(lambda: sum(range(1000)))
    assert peak < 8 * 2**20
