"""The experiment scripts' `--tiny` runs, as their end-to-end tests start them: one intra-op thread, no GPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def run_tiny(script: str, output_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    """`python scripts/<script> --tiny --output-dir <output_dir> <extra>` (10 minutes at most), output captured."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, str(SCRIPTS / script), "--tiny", "--output-dir", str(output_dir), *extra]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)


def result_rows(output_dir: Path) -> dict[str, dict]:
    """key -> row of `<output_dir>/results.jsonl`."""
    rows = [json.loads(line) for line in (output_dir / "results.jsonl").read_text().splitlines()]
    return {row["key"]: row for row in rows}
