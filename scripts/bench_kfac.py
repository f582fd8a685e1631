"""Benchmark K-FAC anchors on SmolLM2-135M's architecture (random weights, CPU): the estimate's cost against a
diagonal estimate of the same sequences, the correction's cost against an AdamW step, and the anchor's size.

    python scripts/bench_kfac.py [--sequences 8] [--new-tokens 32] [--rounds 3] [--threads 2] [--rank 64]
                                 [--device cpu|cuda]

1. Estimate: `estimate_fisher` of the float32 model on the same seeded prompts and sampler, structure "diagonal"
   and "kfac" (the same responses: same seed, batch size and scoring groups), timed one after the other in each
   round (medians). The K-FAC time includes the eigendecompositions.
2. Correction: the model in bfloat16 bound to the K-FAC anchor (`CFPState`), `correct(lam)` against one AdamW step
   (foreach) of the same parameters with gradients set, interleaved over rounds (medians); also with the bases
   truncated to `--rank` eigenpairs per factor (the top block of the same anchor).
3. Size: the anchor's stored floats (eigenvectors, eigenvalues, the diagonal F of the other parameters) per
   parameter it covers.

Last line: RESULT kfac_estimate_vs_diagonal=<x> kfac_correction_vs_adamw=<y> kfac_floats_per_param=<z>
(full rank) kfac_rank<r>_correction_vs_adamw=<w>. Targets (issue 25): x <= 1.5, y <= 1.0, z <= 3.
"""

import argparse
import copy
import statistics
import time

import torch
from bench_peft import smollm2_135m_shaped  # scripts/ is on sys.path when run
from evidence.controls import truncated_anchor

from hf_cfp import FisherAnchor, estimate_fisher
from hf_cfp.protection import CFPState


def timed(fn) -> tuple[float, object]:
    """(seconds, value) of fn(), the device synchronized before and after."""
    synchronize = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    synchronize()
    start = time.perf_counter()
    value = fn()
    synchronize()
    return time.perf_counter() - start, value


def estimates(model, args) -> tuple[float, float, FisherAnchor]:
    """(median diagonal seconds, median K-FAC seconds, the K-FAC anchor)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 49152, (16,), generator=g).tolist() for _ in range(args.sequences)]
    common = dict(
        num_sequences=args.sequences,
        max_new_tokens=args.new_tokens,
        batch_size=4,
        seed=0,
        show_progress=False,
        name="bench",
    )
    diagonal, kfac, anchor = [], [], None
    for _ in range(args.rounds):
        diagonal.append(timed(lambda: estimate_fisher(model, None, prompts, **common))[0])
        seconds, anchor = timed(lambda: estimate_fisher(model, None, prompts, structure="kfac", **common))
        kfac.append(seconds)
    assert isinstance(anchor, FisherAnchor)
    return statistics.median(diagonal), statistics.median(kfac), anchor


def corrections(model, anchor: FisherAnchor, args) -> dict[str, float]:
    """Median seconds of an AdamW step and of the K-FAC correction at full rank and at `args.rank`."""
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    params = [p for p in bf16.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    optimizer = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    lam = 1.0 / anchor.metadata["statistics"]["p99"]
    truncated = truncated_anchor(anchor, args.rank, f"{anchor.name}_r{args.rank}")
    states = {"full": CFPState(bf16, anchor), f"rank{args.rank}": CFPState(bf16, truncated)}
    rows: dict[str, list[float]] = {"adamw": [], **{name: [] for name in states}}
    for _ in range(args.rounds):
        rows["adamw"].append(timed(optimizer.step)[0])
        for name, state in states.items():
            rows[name].append(timed(lambda state=state: state.correct(lam))[0])
    return {name: statistics.median(values) for name, values in rows.items()}


def floats_per_param(anchor: FisherAnchor) -> float:
    stored = sum(t.numel() for t in anchor.fisher.values())
    stored += sum(t.numel() for b in anchor.kfac.values() for t in (b.a_vectors, b.a_values, b.g_vectors, b.g_values))
    covered = sum(t.numel() for t in anchor.fisher.values())
    covered += sum(b.g_vectors.shape[0] * b.a_vectors.shape[0] for b in anchor.kfac.values())
    return stored / covered


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rank", type=int, default=64, help="eigenpairs per factor of the truncated correction")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    parser_device = torch.device(args.device)
    model = smollm2_135m_shaped().to(parser_device).eval()
    diagonal_s, kfac_s, anchor = estimates(model, args)
    print(f"| estimate ({args.sequences} x {args.new_tokens} tokens) | seconds |\n|---|---|")
    print(f"| diagonal | {diagonal_s:.1f} |\n| kfac | {kfac_s:.1f} |")
    times = corrections(model, anchor, args)
    print("\n| step (135M, bf16) | seconds | / AdamW step |\n|---|---|---|")
    for name, seconds in times.items():
        print(f"| {name} | {seconds:.3f} | {seconds / times['adamw']:.2f} |")
    size = floats_per_param(anchor)
    print(f"\nanchor: {len(anchor.kfac)} K-FAC weights, {size:.2f} floats per covered parameter")
    print(
        f"RESULT kfac_estimate_vs_diagonal={kfac_s / diagonal_s:.2f} "
        f"kfac_correction_vs_adamw={times['full'] / times['adamw']:.2f} kfac_floats_per_param={size:.2f} "
        f"kfac_rank{args.rank}_correction_vs_adamw={times[f'rank{args.rank}'] / times['adamw']:.2f}"
    )


if __name__ == "__main__":
    main()
