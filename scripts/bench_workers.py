"""How to spend a 2-core machine on the long run: one worker on two threads, or two workers on one thread each
(`scripts/longrun/workers.py`). On the embedded SmolLM2-135M (float32), each worker process times an SFT step of the
long run's size (forward, backward and AdamW on 4 pirate examples) and a greedy `generate` of 40 new tokens for 16
prompts (the behavioural measure's shape); one process on two threads runs first, then two on one thread at once.

    python scripts/bench_workers.py [--steps 6]

Last line:
    RESULT two_workers_train_throughput=<x> two_workers_generate_throughput=<y>
the work per hour of two one-thread workers over one two-thread worker, from each part's time: 4 t2 / (t1a + t1b)
with t2 the two-thread time and t1a, t1b the concurrent one-thread ones (1.0: no gain; 2.0: the ideal).
"""

import argparse
import json
import os
import subprocess
import sys
import time

import torch


def measure(steps: int) -> dict[str, float]:
    """Seconds of one SFT step and of one generate, in this process (its threads set by the caller)."""
    from hf_cfp.loading import load_embedded_model
    from hf_cfp.loading.examples import sft_examples
    from hf_cfp.loading.prompts import pirate_style_pairs

    model, tokenizer = load_embedded_model()
    rows = sft_examples(tokenizer, pirate_style_pairs()[:4])
    batch = {key: torch.stack([row[key] for row in rows]) for key in rows[0]}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step() -> None:
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    step()  # warm-up: optimizer state, first-call allocations
    start = time.perf_counter()
    for _ in range(steps):
        step()
    train = (time.perf_counter() - start) / steps
    tokenizer.padding_side = "left"
    prompts = tokenizer([p for p, _ in pirate_style_pairs()[:16]], return_tensors="pt", padding=True)
    settings = dict(do_sample=False, pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        model.generate(**prompts, max_new_tokens=4, **settings)
        start = time.perf_counter()
        model.generate(**prompts, max_new_tokens=40, min_new_tokens=40, **settings)
    return {"train": train, "generate": time.perf_counter() - start}


def workers(threads: int, count: int, steps: int) -> list[dict[str, float]]:
    """`count` measuring processes started at once, each on `threads` threads."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, __file__, "--measure", "--steps", str(steps)]
    started = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True) for _ in range(count)]
    return [json.loads(process.communicate()[0].strip().splitlines()[-1]) for process in started]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="timed SFT steps per worker")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # a worker process
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.steps)))
        return
    (one,) = workers(2, 1, args.steps)
    two = workers(1, 2, args.steps)
    print("| part | one worker, 2 threads (s) | two workers, 1 thread each (s) | work per hour, two / one |")
    print("|---|---|---|---|")
    gains = {}
    for part in ("train", "generate"):
        gains[part] = 4 * one[part] / (two[0][part] + two[1][part])
        print(f"| {part} | {one[part]:.2f} | {two[0][part]:.2f}, {two[1][part]:.2f} | {gains[part]:.2f} |")
    fields = " ".join(f"two_workers_{part}_throughput={gain:.2f}" for part, gain in gains.items())
    print(f"RESULT {fields}")


if __name__ == "__main__":
    main()
