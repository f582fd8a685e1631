"""benchkit.resident: the rise of the peak resident set during a call, against the bytes the call touched, measured
in a fresh process (as its docstring asks: one that ran other work may reuse memory it freed without it showing)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc/self")

SCRIPTS = Path(__file__).resolve().parents[3] / "scripts"
MEASURE = """
import json, torch
from benchkit.resident import peak_rss_increase
size = 64 * 2**20  # 64 MB, every page written so that it is resident

def fill():
    buffer = torch.ones(size, dtype=torch.uint8)
    return int(buffer[::4096].sum())

pages, peak = peak_rss_increase(fill)
_, idle = peak_rss_increase(lambda: sum(range(1000)))
print(json.dumps({"size": size, "pages": pages, "peak": peak, "idle": idle}))
"""


def test_the_peak_rise_counts_a_buffer_the_call_fills_and_frees():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SCRIPTS), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", MEASURE], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    shown = json.loads(result.stdout.strip().splitlines()[-1])
    size = shown["size"]
    assert shown["pages"] == size // 4096  # the call's own result comes back
    assert size <= shown["peak"] < 2 * size  # the buffer, not much more (freed before the peak is read)
    assert shown["idle"] < 8 * 2**20  # a call that allocates nothing raises the peak by little
