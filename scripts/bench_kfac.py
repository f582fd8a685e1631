"""Benchmark K-FAC anchors on SmolLM2-135M's architecture (random weights, CPU): the estimate's cost against a
diagonal estimate of the same sequences, the correction's cost against an AdamW step, and the anchor's size, at
full rank and at rank R (`--rank`: the top R eigenpairs of each factor and the mean of the rest, its tail).

    python scripts/bench_kfac.py [--sequences 8] [--new-tokens 32] [--rounds 3] [--threads 2] [--rank 256]
                                 [--device cpu|cuda] [--quick]

R defaults to 256, the rank the sweep of `scripts/reproduce_table.py` recommends for models where full rank does not
fit (`docs/guides/kfac.md`; the embedded model's 576-wide factors keep 44% of their eigenpairs at it, so the
size and cost targets, set for a small share, are for wider models' sake). `--quick`: 4 sequences, 1 round (a
smoke run; its medians are single measurements).

1. Estimate: `estimate_fisher` of the float32 model on the same seeded prompts and sampler, structure "diagonal",
   "kfac" (full rank) and "kfac" with `kfac_rank=R` (the same responses: same seed, batch size and scoring
   groups), timed one after the other in each round (medians over rounds). The K-FAC times include the
   eigendecompositions (and, for factors too wide to form, the sketch and its second scoring pass).
2. Correction: the model in bfloat16 bound to each anchor (`CFPState`), `correct(lam)` against one AdamW step
   (foreach) of the same parameters with gradients set, interleaved over rounds after one untimed warm-up of each
   (medians). Rows: full rank; rank R with its mean tail (the rank-R estimate); rank R without a tail (the same
   eigenpairs, no tail: the plain truncation that treats the rest as free, two rotations; for comparison); and
   the rank-R tailed correction of the factored weights alone (an anchor of the K-FAC bases only) against an AdamW
   step of those weights alone.
3. Size: floats stored (eigenvectors, eigenvalues, tails, the diagonal F of the other parameters) per parameter
   covered; at rank R, of the factored weights alone: ((in + out) R + 2 R + 2) / (in out) summed over them.
4. Two anchors (skipped with `--no-two-anchors`): on the embedded SmolLM2-135M-Instruct (float32, as the demo and
   the evidence train it), rank-R anchors of math and of safety (`--anchor-sequences` sequences of
   `--new-tokens` tokens each, on the bundled calibration prompts), both at c = 10 (lam_k = 10 / p99_k), then
   `--sft-steps` AdamW steps (lr 5e-5) of the pirate SFT set protected by math alone (the closed form; the
   summed solve is too slow to train through on a CPU), then one more step's proposal: the correction of the
   weights of layers `--layers` (every kind in them: a sample, as timing the whole model's summed solve takes
   most of an hour) with math alone against math and safety summed (conjugate gradient,
   `geometry.kronecker.summed_solve`), both from that same proposal (restored before each, untimed), interleaved over
   rounds; with the summed solve's iterations per weight.

Last line:
    RESULT kfac_estimate_vs_diagonal=<x> kfac_correction_vs_adamw=<y> kfac_floats_per_param=<z>
           kfac_rankR_correction_vs_adamw=<w> kfac_rankR_floats_per_param=<v> kfac_rankR_estimate_vs_diagonal=<u>
           kfac_rankR_factored_correction_vs_adamw=<t> kfac_two_anchor_correction_vs_one=<s>
           kfac_two_anchor_iterations=<i>
The first three at full rank (targets, issue 25: x <= 1.5, y <= 1.0, z <= 3). At rank R (issue 30, on a CPU):
w <= 1.0 (the whole model's correction, K-FAC at rank R with tails plus the diagonal F of the rest, over the whole
model's AdamW step: the definition of `kfac_correction_vs_adamw`), v <= 0.3, u <= 1.5; t: the factored weights'
correction over their own AdamW step (no target; the share the K-FAC part costs). Two anchors (issue 48): s <= 3
(the target); i, the mean conjugate-gradient iterations per weight at that step. Before issue 30,
`kfac_rank64_correction_vs_adamw` measured the plain truncation (no tail): that is now the table's "no tail" row.

On a shared, loaded machine pass `--threads 1`: multi-threaded LAPACK and BLAS collapse when other processes hold
the cores (a float64 `eigh` of 1536 x 1536 took 52 s with 2 threads against 2.2 s with 1 on a 2-core machine at
load 4). On a CPU the correction's temporaries are fresh float32 tensors of a batch of weights each; glibc returns
large ones to the system, and their first touch (page faults) can cost as much as the arithmetic: measured here as
is, with the default allocator. The correction adds its product into each weight in place
(`geometry.kronecker.basis`), so its only weight-sized temporary is one batch's displacement.
"""

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch
from bench_peft import smollm2_135m_shaped  # scripts/ is on sys.path when run

from hf_cfp import FisherAnchor, estimate_fisher
from hf_cfp.geometry.kronecker.artifact import stored_parts
from hf_cfp.geometry.kronecker.basis import KroneckerBasis
from hf_cfp.loading import load_embedded_model
from hf_cfp.loading.examples import sft_examples
from hf_cfp.loading.prompts import calibration_prompts, pirate_style_pairs
from hf_cfp.protection import CFPState


def timed(fn) -> tuple[float, object]:
    """(seconds, value) of fn(), the device synchronized before and after."""
    synchronize = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    synchronize()
    start = time.perf_counter()
    value = fn()
    synchronize()
    return time.perf_counter() - start, value


def interleaved(jobs: dict[str, Callable[[], object]], rounds: int) -> tuple[dict[str, float], dict[str, object]]:
    """(median seconds, last value) of each job, the jobs run one after the other in each of `rounds` rounds."""
    seconds: dict[str, list[float]] = {name: [] for name in jobs}
    values: dict[str, object] = {}
    for _ in range(rounds):
        for name, job in jobs.items():
            elapsed, values[name] = timed(job)
            seconds[name].append(elapsed)
    return {name: statistics.median(s) for name, s in seconds.items()}, values


def estimates(model, args) -> tuple[dict[str, float], FisherAnchor, FisherAnchor]:
    """(median seconds of the diagonal, full-rank and rank-R estimates, the full-rank anchor, the rank-R one)."""
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
    jobs = {
        "diagonal": lambda: estimate_fisher(model, None, prompts, **common),
        "kfac": lambda: estimate_fisher(model, None, prompts, structure="kfac", **common),
        "kfac_rank": lambda: estimate_fisher(model, None, prompts, structure="kfac", kfac_rank=args.rank, **common),
    }
    seconds, anchors = interleaved(jobs, args.rounds)
    full, ranked = anchors["kfac"], anchors["kfac_rank"]
    assert isinstance(full, FisherAnchor) and isinstance(ranked, FisherAnchor)
    return seconds, full, ranked


def corrections(model, full: FisherAnchor, ranked: FisherAnchor, args) -> tuple[dict[str, float], int, int]:
    """(median seconds of each AdamW step and correction, parameters of the model, of its factored weights)."""
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    params = [p for p in bf16.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    named = dict(bf16.named_parameters())
    factored = [named[name] for name in ranked.kfac]
    lam = 1.0 / full.metadata["statistics"]["p99"]
    r = args.rank
    untailed = {
        name: KroneckerBasis(b.a_vectors, b.a_values, b.g_vectors, b.g_values) for name, b in ranked.kfac.items()
    }
    anchors = {
        "full": full,
        f"rank{r}": ranked,
        f"rank{r}_no_tail": FisherAnchor(dict(ranked.fisher), name=f"bench_r{r}_no_tail", kfac=untailed),
        f"rank{r}_factored": FisherAnchor({}, name=f"bench_r{r}_factored", kfac=dict(ranked.kfac)),
    }
    states = {name: CFPState(bf16, anchor) for name, anchor in anchors.items()}
    adamw = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    adamw_factored = torch.optim.AdamW(factored, lr=1e-4, foreach=True)
    jobs: dict[str, Callable[[], object]] = {"adamw": adamw.step, "adamw_factored": adamw_factored.step}
    jobs.update({name: (lambda state=state: state.correct(lam)) for name, state in states.items()})
    interleaved(jobs, 1)  # warm-up: optimizer states, first-call allocations
    seconds, _ = interleaved(jobs, args.rounds)
    return seconds, sum(p.numel() for p in params), sum(p.numel() for p in factored)


def two_anchors(args) -> tuple[dict[str, float], float]:
    """(median seconds of the one- and two-anchor corrections of one realistic proposal, on the sampled layers'
    weights, and the summed solve's mean iterations per weight)."""
    model, tokenizer = load_embedded_model()
    common = dict(num_sequences=args.anchor_sequences, max_new_tokens=args.new_tokens, seed=0, show_progress=False)
    anchors = [
        estimate_fisher(
            model, tokenizer, calibration_prompts(name), structure="kfac", kfac_rank=args.rank, name=name, **common
        )
        for name in ("math", "safety")
    ]
    lams = [10.0 / a.metadata["statistics"]["p99"] for a in anchors]
    rows = sft_examples(tokenizer, pirate_style_pairs()[:8])
    batch = {key: torch.stack([row[key] for row in rows]) for key in rows[0]}
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
    path = CFPState(model, anchors[0])
    sampled = [
        FisherAnchor({}, name=a.name, kfac={n: a.kfac[n] for n in a.kfac_names if _layer(n) in args.layers})
        for a in anchors
    ]
    both, alone = CFPState(model, sampled), CFPState(model, sampled[0])
    for step in range(args.sft_steps + 1):
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step < args.sft_steps:  # the last step is the proposal timed below
            path.correct(lams[:1])
    proposal = {n: p.detach().clone() for n, p in model.named_parameters()}

    def corrected(state, lam):
        def job():
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(proposal[n])
            return timed(lambda: state.correct(lam))[0]

        return job

    jobs = {"one": corrected(alone, lams[:1]), "two": corrected(both, lams)}
    seconds: dict[str, list[float]] = {name: [] for name in jobs}
    for _ in range(args.rounds + 1):  # the first round a warm-up; each job times its correction (not the restore)
        for name, job in jobs.items():
            seconds[name].append(job())
    return {name: statistics.median(s[1:]) for name, s in seconds.items()}, both.summed.mean_iterations


def two_anchor_table(args) -> str:
    """Stage 4's table, printed; its RESULT fields."""
    seconds, iterations = two_anchors(args)
    ratio = seconds["two"] / seconds["one"]
    layers = ", ".join(map(str, args.layers))
    print(f"\n| correction of one proposal, layers {layers} (135M, rank {args.rank}, c = 10) | seconds | / one |")
    print("|---|---|---|")
    print(f"| math alone (closed form) | {seconds['one']:.3f} | 1.00 |")
    print(f"| math + safety (summed, {iterations:.1f} iterations per weight) | {seconds['two']:.3f} | {ratio:.2f} |")
    return f" kfac_two_anchor_correction_vs_one={ratio:.2f} kfac_two_anchor_iterations={iterations:.1f}"


def _layer(name: str) -> int | None:
    """The decoder layer index in a weight name (`model.layers.<i>....`), None outside the layers."""
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[1] == "layers" else None


def floats_per_param(anchor: FisherAnchor, factored_only: bool = False) -> float:
    """Floats the anchor stores per parameter it covers (of its K-FAC weights alone with `factored_only`)."""
    stored = sum(t.numel() for b in anchor.kfac.values() for t in stored_parts(b).values())
    covered = sum(b.g_vectors.shape[-2] * b.a_vectors.shape[-2] for b in anchor.kfac.values())
    if not factored_only:
        stored += sum(t.numel() for t in anchor.fisher.values())
        covered += sum(t.numel() for t in anchor.fisher.values())
    return stored / covered


def parse_args(argv=None) -> argparse.Namespace:
    """The benchmark's options; `--quick` sets 4 sequences and 1 round."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--rank", type=int, default=256, help="R: eigenpairs kept per factor (with the mean tail); the sweep's rank"
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--quick", action="store_true", help="4 sequences, 1 round: a smoke run")
    stages = parser.add_mutually_exclusive_group()
    stages.add_argument("--no-two-anchors", action="store_true", help="skip stage 4 (it loads the embedded model)")
    stages.add_argument("--only-two-anchors", action="store_true", help="stage 4 alone")
    parser.add_argument("--anchor-sequences", type=int, default=16, help="stage 4: sequences per anchor")
    parser.add_argument("--sft-steps", type=int, default=4, help="stage 4: protected SFT steps before the proposal")
    parser.add_argument(
        "--layers",
        type=int,
        nargs="+",
        default=[0, 15, 29],
        help="stage 4: the decoder layers whose weights are timed",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.sequences, args.rounds = 4, 1
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    r = args.rank
    if args.only_two_anchors:
        print(f"RESULT{two_anchor_table(args)}")
        return
    model = smollm2_135m_shaped().to(torch.device(args.device)).eval()

    estimate_s, full, ranked = estimates(model, args)
    print(
        f"| estimate ({args.sequences} x {args.new_tokens} tokens, median of {args.rounds}) | seconds | / diagonal |"
    )
    print("|---|---|---|")
    for label, key in (("diagonal", "diagonal"), ("kfac, full rank", "kfac"), (f"kfac, rank {r}", "kfac_rank")):
        print(f"| {label} | {estimate_s[key]:.1f} | {estimate_s[key] / estimate_s['diagonal']:.2f} |")

    times, n_params, n_factored = corrections(model, full, ranked, args)
    print(f"\n| step (135M, bf16, median of {args.rounds}) | parameters | seconds | / AdamW step of them |")
    print("|---|---|---|---|")
    every, factored = f"all {n_params / 1e6:.1f} M", f"factored {n_factored / 1e6:.1f} M"
    rows = (
        ("AdamW step", every, "adamw", "adamw"),
        ("CFP, K-FAC full rank", every, "full", "adamw"),
        (f"CFP, K-FAC rank {r}, mean tail", every, f"rank{r}", "adamw"),
        (f"CFP, K-FAC rank {r}, no tail (the rest free)", every, f"rank{r}_no_tail", "adamw"),
        ("AdamW step", factored, "adamw_factored", "adamw_factored"),
        (f"CFP, K-FAC rank {r}, mean tail", factored, f"rank{r}_factored", "adamw_factored"),
    )
    for label, which, key, reference in rows:
        print(f"| {label} | {which} | {times[key]:.3f} | {times[key] / times[reference]:.2f} |")

    size, size_r, size_r_factored = floats_per_param(full), floats_per_param(ranked), floats_per_param(ranked, True)
    print(
        f"\nanchor: {len(full.kfac)} K-FAC weights; floats per covered parameter: full rank {size:.2f}, rank {r} "
        f"{size_r:.2f} (with the diagonal F of the rest), rank {r} of the factored weights alone {size_r_factored:.3f}"
    )
    two = "" if args.no_two_anchors else two_anchor_table(args)
    print(
        f"RESULT kfac_estimate_vs_diagonal={estimate_s['kfac'] / estimate_s['diagonal']:.2f} "
        f"kfac_correction_vs_adamw={times['full'] / times['adamw']:.2f} kfac_floats_per_param={size:.2f} "
        f"kfac_rank{r}_correction_vs_adamw={times[f'rank{r}'] / times['adamw']:.2f} "
        f"kfac_rank{r}_floats_per_param={size_r_factored:.3f} "
        f"kfac_rank{r}_estimate_vs_diagonal={estimate_s['kfac_rank'] / estimate_s['diagonal']:.2f} "
        f"kfac_rank{r}_factored_correction_vs_adamw={times[f'rank{r}_factored'] / times['adamw_factored']:.2f}" + two
    )


if __name__ == "__main__":
    main()
