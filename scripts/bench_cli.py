"""Benchmark the command line's start-up: `hf-cfp --help` and `hf-cfp inspect` against `import torch`.

Every command used to import torch, transformers and accelerate first (`hf-cfp --help` took ~4 s on 2 cores,
`inspect` of the demo's 135M-coordinate anchor 29-34 s and 384 lines). Each is run as a fresh process
(`python -m hf_cfp.cli ...`), interleaved over rounds; the table gives median wall times and their ratio to a
process that only runs `import torch`. The last line is machine-readable:

  RESULT help_vs_import_torch=<x> inspect_vs_import_torch=<y>

Anchor: `--anchor DIR` (e.g. cfp-demo/anchor-math), else a synthetic one over a SmolLM2-135M-shaped Llama
(`bench_peft.synthetic_anchor`, 135M coordinates, ~540 MB, written to a temporary directory once).
`--full` also times `inspect --full` (reads every tensor: tens of seconds).

    python scripts/bench_cli.py [--anchor DIR] [--rounds 5] [--full]
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def wall_time(argv: list[str]) -> float:
    """Seconds for one fresh `python argv...` process to finish (it must succeed)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    subprocess.run([sys.executable, *argv], env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def synthetic_anchor_directory(directory: str) -> str:
    from bench_peft import smollm2_135m_shaped, synthetic_anchor  # scripts/ is on sys.path for a script

    path = os.path.join(directory, "anchor")
    synthetic_anchor(smollm2_135m_shaped()).save_pretrained(path)
    return path


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--anchor", default=None, help="an anchor directory (default: a synthetic 135M one)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds after one warm-up round")
    parser.add_argument("--full", action="store_true", help="also time `inspect --full`")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-cli-") as scratch:
        anchor = args.anchor or synthetic_anchor_directory(scratch)
        commands = {
            "import torch": ["-c", "import torch"],
            "hf-cfp --help": ["-m", "hf_cfp.cli", "--help"],
            "hf-cfp inspect": ["-m", "hf_cfp.cli", "inspect", anchor],
        }
        if args.full:
            commands["hf-cfp inspect --full"] = ["-m", "hf_cfp.cli", "inspect", anchor, "--full"]
        times: dict[str, list[float]] = {name: [] for name in commands}
        for round_ in range(args.rounds + 1):
            row = {name: wall_time(argv) for name, argv in commands.items()}
            if round_ > 0:  # round 0 warms the file cache
                for name, seconds in row.items():
                    times[name].append(seconds)
            print(f"round {round_}: " + " ".join(f"{n}={s:.2f}s" for n, s in row.items()), flush=True)
    medians = {name: statistics.median(values) for name, values in times.items()}
    base = medians["import torch"]
    which = args.anchor or "synthetic, SmolLM2-135M-shaped"
    print(f"\nanchor: {which}; medians of {args.rounds} rounds, fresh processes, OMP_NUM_THREADS=1")
    print(f"{'':>22} | {'median s':>9} | {'/ import torch':>14}")
    for name, seconds in medians.items():
        print(f"{name:>22} | {seconds:>9.3f} | {seconds / base:>14.3f}")
    print(
        f"RESULT help_vs_import_torch={medians['hf-cfp --help'] / base:.3g} "
        f"inspect_vs_import_torch={medians['hf-cfp inspect'] / base:.3g}"
    )


if __name__ == "__main__":
    main()
