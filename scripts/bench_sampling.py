"""Benchmark on-policy sampling: `model.generate` with the support recorder against the token-by-token sampler.

Until issue 32, `hf_cfp/fisher/sampling.py` decoded token by token with its own KV-cache handling and its own
temperature / top-k / top-p, drawing each token with `torch.multinomial` on the CPU; now it runs `model.generate`
with the sampler's warpers and a logits processor that records each step's support. The old module is read from
git (`git show REV:hf_cfp/fisher/sampling.py`, REV the last commit that had it) into a temporary directory
outside the repository and imported from there; both then draw the same batches of the same prompts, interleaved
over rounds, with no EOS (every response has `--new-tokens` tokens, so both generate the same number of tokens).
The table gives the median seconds per round (all batches) and generated tokens per second, then the ratio of
each round (the two samplers timed back to back: less swayed by a shared machine's load); the last line is
machine-readable:

  RESULT sampling_generate_vs_by_hand=<new / old, median seconds> generate_tokens_per_s=<x> by_hand_tokens_per_s=<y>

(a ratio below 1: generate is faster). Where git or the old module is not there (a copy of the tree without
.git), only the new sampler is timed and the ratio is "not measured". Model: the embedded SmolLM2-135M-Instruct
(`load_causal_lm`, offline), prompts: the first `--prompts` of the bundled math calibration set.

    OMP_NUM_THREADS=1 python scripts/bench_sampling.py [--prompts 16] [--new-tokens 32] [--batch 8] [--rounds 5]
        [--sampler plain|truncated] [--device cpu|cuda] [--threads 1] [--rev af1a428...]
"""

import argparse
import importlib.util
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
OLD_SAMPLER_REV = "af1a42843edebaff9e564d0f8da7ab2e9eff8975"  # the last commit with the token-by-token sampler


def load_old_sampling(rev: str, directory: str):
    """The module `hf_cfp/fisher/sampling.py` at `rev`, written to `directory` and imported as `old_sampling`
    (its relative imports made absolute); None, with the reason printed, when git cannot show it."""
    shown = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:hf_cfp/fisher/sampling.py"], capture_output=True, text=True
    )
    if shown.returncode != 0:
        print(f"old sampler: not measured (git show {rev[:7]} failed: {shown.stderr.strip()[:120]})")
        return None
    path = Path(directory) / "old_sampling.py"
    path.write_text(shown.stdout.replace("from ..errors import", "from hf_cfp.errors import"))
    spec = importlib.util.spec_from_file_location("old_sampling", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def draw_all(module, model, batches, sampler_settings: dict, new_tokens: int, device: str) -> tuple[float, int]:
    """Seconds to draw every batch with `module.sample_responses` (batch k from `batch_generator(0, k)`), and the
    number of tokens drawn."""
    sampler = module.Sampler(**sampler_settings)
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    drawn = [
        module.sample_responses(model, batch, sampler, new_tokens, set(), 0, module.batch_generator(0, k))
        for k, batch in enumerate(batches)
    ]
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, sum(len(r) for responses in drawn for r in responses)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds after one warm-up round")
    parser.add_argument(
        "--sampler", choices=("plain", "truncated"), default="plain", help="truncated: T 0.8, k 50, p 0.95"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rev", default=OLD_SAMPLER_REV, help="the commit to read the old sampler from")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from hf_cfp.fisher import sampling as new_sampling
    from hf_cfp.fisher.token_ids import to_token_ids
    from hf_cfp.loading.models import load_causal_lm
    from hf_cfp.loading.prompts import calibration_prompts

    model, tokenizer = load_causal_lm()
    model = model.to(args.device).eval()
    prompts = to_token_ids(calibration_prompts("math"), tokenizer)[: args.prompts]
    batches = [prompts[i : i + args.batch] for i in range(0, len(prompts), args.batch)]
    settings = {} if args.sampler == "plain" else {"temperature": 0.8, "top_k": 50, "top_p": 0.95}
    with tempfile.TemporaryDirectory(prefix="bench-sampling-") as scratch:
        old_sampling = load_old_sampling(args.rev, scratch)
        samplers = {"generate": new_sampling, **({"by hand": old_sampling} if old_sampling else {})}
        times: dict[str, list[float]] = {name: [] for name in samplers}
        tokens = {}
        for round_index in range(args.rounds + 1):  # round 0 warms up
            for name, module in samplers.items():
                seconds, tokens[name] = draw_all(module, model, batches, settings, args.new_tokens, args.device)
                if round_index:
                    times[name].append(seconds)
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(
        f"\nSmolLM2-135M on {args.device} ({args.threads} thread(s)), {len(prompts)} prompts (mean "
        f"{statistics.mean(map(len, prompts)):.0f} tokens) x {args.new_tokens} new tokens, batch {args.batch}, "
        f"sampler {settings or 'T 1, no truncation'}; medians of {args.rounds} interleaved rounds"
    )
    print(f"{'sampler':>9} | {'median s':>9} | {'tokens/s':>8} | {'/ by hand':>9} | rounds (s)")
    for name, median in medians.items():
        ratio = f"{median / medians['by hand']:.3f}" if "by hand" in medians else "-"
        rounds = " ".join(f"{t:.2f}" for t in times[name])
        print(f"{name:>9} | {median:>9.3f} | {tokens[name] / median:>8.1f} | {ratio:>9} | {rounds}")
    if "by hand" in medians:
        paired = [new / old for new, old in zip(times["generate"], times["by hand"], strict=True)]
        print("generate / by hand, round by round: " + " ".join(f"{r:.2f}" for r in paired))
    result = {"generate_tokens_per_s": f"{tokens['generate'] / medians['generate']:.3g}"}
    if "by hand" in medians:
        result = {
            "sampling_generate_vs_by_hand": f"{medians['generate'] / medians['by hand']:.3g}",
            **result,
            "by_hand_tokens_per_s": f"{tokens['by hand'] / medians['by hand']:.3g}",
        }
    print("RESULT " + " ".join(f"{k}={v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
