"""Soak test: a long transformers.Trainer run with CFP protection and two monitor anchors.

Measures resident memory (RSS, from /proc/self/statm) every `--every` steps, the growth after
warm-up and the least-squares slope of RSS per step after warm-up, set against the size of one
float32 copy of the covered parameters (what a leak of the per-log `theta - theta0` would add at
every logging step), the open file descriptors before and after training, and whether every logged
metric stayed finite. Asserts nothing: it prints a table and a final machine-readable line

    RESULT rss_growth_mb=<x> rss_slope_kb_per_step=<s> delta_copy_kb=<c> fd_growth=<y> finite=<true|false>

Run: python scripts/soak.py [--steps 500] [--warmup 50] [--every 50]
(CPU only, a tiny Llama; about a minute for 500 steps on one core.)
"""

import argparse
import gc
import math
import os
import tempfile

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_callback import PrinterCallback

from hf_cfp import CFPCallback, FisherAnchor
from hf_cfp.loading.models import tiny_llama

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mb() -> float:
    """Resident set size of this process, in MiB (after a garbage collection)."""
    gc.collect()
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * PAGE / 2**20


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _tiny_llama(vocab: int, seed: int = 0):
    return tiny_llama(vocab_size=vocab, hidden_size=32, seed=seed, max_position_embeddings=64)


def _fisher(model, seed: int, keep=lambda name: True) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.rand(p.shape, generator=g) for n, p in model.named_parameters() if keep(n)}


def _dataset(vocab: int, n: int = 64, length: int = 16, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (length,), generator=g)
        rows.append({"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)})
    return rows


class _Probe(TrainerCallback):
    """Samples RSS every `every` optimizer steps (and at `warmup`)."""

    def __init__(self, warmup: int, every: int):
        self.warmup, self.every, self.rss = warmup, every, {}

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        if step == self.warmup or step % self.every == 0 or step == state.max_steps:
            self.rss[step] = rss_mb()


def least_squares_slope(points: dict[int, float]) -> float:
    """Slope of the least-squares line through (step, value) points (at least two steps)."""
    if len(points) < 2:
        raise ValueError(f"a slope needs at least two points, got {len(points)}")
    mean_x = sum(points) / len(points)
    mean_y = sum(points.values()) / len(points)
    spread = sum((x - mean_x) ** 2 for x in points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points.items()) / spread


def soak(steps: int = 500, warmup: int = 50, every: int = 50, vocab: int = 64) -> dict:
    """Run the soak (every step is a logging step); returns rss (step -> MiB), rss_growth_mb (end
    minus warm-up), rss_slope_mb_per_step (least-squares slope of the samples from warm-up on),
    delta_copy_mb (4 bytes x the parameters CFP covers: one float32 copy of theta - theta0),
    logging_steps, fd_start, fd_end, fd_growth, finite (every logged number finite), logs
    (number of log entries)."""
    torch.set_num_threads(1)
    model = _tiny_llama(vocab)
    protect = FisherAnchor(_fisher(model, 1), name="math")
    monitors = [
        FisherAnchor(_fisher(model, 2, lambda n: "mlp" in n), name="code"),
        FisherAnchor(_fisher(model, 3, lambda n: "attn" in n), name="chat"),
    ]
    probe = _Probe(min(warmup, steps), every)
    with tempfile.TemporaryDirectory(prefix="hf-cfp-soak-") as out:
        args = TrainingArguments(
            output_dir=out,
            use_cpu=True,
            report_to=[],
            logging_steps=1,
            max_steps=steps,
            per_device_train_batch_size=4,
            learning_rate=1e-3,
            save_strategy="no",
            disable_tqdm=True,
            seed=0,
            dataloader_num_workers=0,
        )
        callback = CFPCallback(protect, lam=1.0, monitor=monitors)
        trainer = Trainer(model=model, args=args, train_dataset=_dataset(vocab), callbacks=[callback, probe])
        trainer.remove_callback(PrinterCallback)  # every step is logged: keep stdout to the table
        fd_start = open_fds()
        # Objects alive before training (torch, transformers, the model: ~400k) go to gc's permanent
        # generation, so each RSS sample's full collection scans only what training creates (a
        # collection of everything took 0.75 s on 2 busy cores; garbage made during training is still freed).
        gc.collect()
        gc.freeze()
        try:
            trainer.train()
        finally:
            gc.unfreeze()
        fd_end = open_fds()
        history = trainer.state.log_history
    logs = [h for h in history if "loss" in h]
    numbers = [v for h in logs for k, v in h.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    cfp_keys = {k for h in logs for k in h if k.startswith("cfp/")}
    finite = bool(logs) and all(math.isfinite(v) for v in numbers) and len(cfp_keys) >= 7
    warm = probe.rss[probe.warmup]
    covered = sum(t.numel() for t in callback.protection.theta0)  # the union of the anchors' parameters
    return {
        "rss": dict(sorted(probe.rss.items())),
        "rss_growth_mb": probe.rss[max(probe.rss)] - warm,
        "rss_slope_mb_per_step": least_squares_slope({s: r for s, r in probe.rss.items() if s >= probe.warmup}),
        "delta_copy_mb": 4 * covered / 2**20,
        "logging_steps": args.logging_steps,
        "fd_start": fd_start,
        "fd_end": fd_end,
        "fd_growth": fd_end - fd_start,
        "finite": finite,
        "logs": len(logs),
        "cfp_keys": sorted(cfp_keys),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--every", type=int, default=50)
    options = parser.parse_args(argv)
    result = soak(options.steps, options.warmup, options.every)
    print(f"{'step':>6}  {'RSS MiB':>9}")
    for step, rss in result["rss"].items():
        print(f"{step:>6}  {rss:>9.1f}")
    print(f"log entries: {result['logs']} (cfp keys: {', '.join(result['cfp_keys'])})")
    print(f"RSS growth after warm-up (step {options.warmup}): {result['rss_growth_mb']:+.2f} MiB")
    slope_kb, copy_kb = 1024 * result["rss_slope_mb_per_step"], 1024 * result["delta_copy_mb"]
    print(f"RSS slope after warm-up: {slope_kb:+.2f} KiB per step (one copy of the deltas: {copy_kb:.1f} KiB)")
    print(f"open file descriptors: {result['fd_start']} at start, {result['fd_end']} at end")
    print(f"all metrics finite: {result['finite']}")
    print(
        f"RESULT rss_growth_mb={result['rss_growth_mb']:.2f} rss_slope_kb_per_step={slope_kb:.2f} "
        f"delta_copy_kb={copy_kb:.1f} fd_growth={result['fd_growth']} "
        f"finite={str(result['finite']).lower()}"
    )


if __name__ == "__main__":
    main()
