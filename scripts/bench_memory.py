"""Benchmark CFP's memory per parameter and the cost of its bounded (chunked) correction and metrics.

Model: SmolLM2-135M's architecture from config (random weights) in bfloat16, with the synthetic heavy-tailed
anchor of bench_peft.py over every parameter. For each memory plan of `CFPState`:

  dense       theta0 in the parameters' dtype (bf16) + F float32            (the default)
  bf16f       theta0 bf16 + F bfloat16                                       (fisher_dtype="bfloat16")
  sparse      the top 1% of F corrected on the device; theta0 and F for the metrics offloaded to CPU memory

it reports the extra bytes per parameter CFP holds beside the parameters (the training device) and offloaded,
counted from the tensors it keeps (`CFPState.footprint`; on a GPU also torch.cuda.memory_allocated before and
after binding), and times, interleaved over rounds (medians):

  copy        torch._foreach_copy_ of the parameters from a same-size copy (the memory-traffic floor)
  adamw       one AdamW step (foreach) with gradients set
  correction  CFPState.correct(lam), lam = 1 / p99
  metrics     CFPState.drift_metrics()

then the error of keeping F in bfloat16: two copies of a 500k-parameter bf16 vector follow the same persistent
noisy proposals for `--steps` steps, one corrected with F in float32, one with F rounded to bf16, and the
distance between their paths is reported relative to the drift itself; and, in a fresh process, the peak
resident memory of the anchor's statistics (`fisher_statistics`; `concentration` shown too) against the anchor's
own size. Each pass's floor is the bytes its formula must move at the copy's measured bandwidth (the table after
the timings; the KL budget is timed as one evaluation pass of its solve and as a whole budget step, solve and
correction, with the budget at half the predicted KL the AdamW steps made). Last line:

  RESULT correction_vs_floor=<f> bf16f_correction_vs_floor=<g> budget_pass_vs_correction=<p>
         budget_step_vs_correction=<q> correction_vs_copy=<x> metrics_vs_correction=<y> dense_bytes_per_param=<d>
         bf16f_bytes_per_param=<b> sparse_bytes_per_param=<s> stats_peak_vs_anchor=<t>

Targets: f <= 1.25 and g <= 1.25 on this CPU (issue 26); y <= 2.0, d <= 6, b <= 4, s <= 0.3, t <= 1.5 (issue 14).

    python scripts/bench_memory.py [--rounds 5] [--threads 2] [--device cpu|cuda]
"""

import argparse
import statistics
import subprocess
import sys
import time

import torch
from bench_peft import smollm2_135m_shaped, synthetic_anchor  # scripts/ is on sys.path when run

PLANS = {"dense": {}, "bf16f": {"fisher_dtype": "bfloat16"}, "sparse": {"sparse": 0.01}}
PROJECTED_PARAMETERS = 7.6e9  # Qwen2.5-7B-Instruct, the paper's model


def synchronized(device: torch.device):
    def timed(fn) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    return timed


def stats_worker() -> None:
    """In this fresh process: an anchor of the model's shape (filled in place), then the rise of the peak resident
    set during `fisher_statistics` (computed at every estimation and save) and during `concentration`."""
    from benchkit.resident import peak_rss_increase

    from hf_cfp.anchor.statistics import concentration, fisher_statistics

    model = smollm2_135m_shaped()
    shapes = {n: p.shape for n, p in model.named_parameters()}
    del model
    g = torch.Generator().manual_seed(1)
    fisher = {n: torch.empty(s).exponential_(generator=g) for n, s in shapes.items()}
    anchor_bytes = sum(f.nbytes for f in fisher.values())
    _, statistics_peak = peak_rss_increase(lambda: fisher_statistics(fisher))
    _, concentration_peak = peak_rss_increase(lambda: concentration(fisher))
    print(f"{anchor_bytes} {statistics_peak} {concentration_peak}")


def bf16_fisher_error(steps: int, numel: int = 500_000) -> tuple[float, float]:
    """(||theta_bf16F - theta_f32F|| / ||theta_f32F - theta0||, relative difference of sum F Delta^2) after `steps`
    steps of the same proposals (a persistent direction plus noise, lr 1e-3) from the same bf16 theta0, lam F
    log-normal around 1 (the regime where the pull is neither negligible nor saturated)."""
    from hf_cfp.ops import proximal_pull_

    g = torch.Generator().manual_seed(0)
    theta0 = torch.randn(numel, generator=g).bfloat16()
    fisher = (2.0 * torch.randn(numel, generator=g)).exp()
    direction = torch.randn(numel, generator=g)
    paths = {"float32": theta0.clone(), "bfloat16": theta0.clone()}
    for _ in range(steps):
        step = 1e-3 * (direction + torch.randn(numel, generator=g))
        for dtype, theta in paths.items():
            theta.copy_(theta.float() + step)
            proximal_pull_([theta], [theta0], [[fisher.to(getattr(torch, dtype))]], [1.0])
    exact, rounded = (paths[d].double() - theta0.double() for d in ("float32", "bfloat16"))
    f = fisher.double()
    sensitive = [float((f * d**2).sum()) for d in (exact, rounded)]
    return float((rounded - exact).norm() / exact.norm()), abs(sensitive[1] / sensitive[0] - 1)


def bind_plans(model, anchor, numel: int):
    """One `CFPState` per memory plan, and each plan's (beside, offloaded, measured on cuda) bytes per parameter."""
    from hf_cfp.protection import CFPState, MemoryPlan

    cuda = next(model.parameters()).device.type == "cuda"
    per_param: dict[str, tuple[float, float, float | None]] = {}
    states = {}
    for name, plan in PLANS.items():
        allocated = torch.cuda.memory_allocated() if cuda else None
        states[name] = CFPState(model, anchor, memory=MemoryPlan(**plan))
        measured = (torch.cuda.memory_allocated() - allocated) / numel if allocated is not None else None
        beside, offloaded = states[name].footprint()
        per_param[name] = (beside / numel, offloaded / numel, measured)
    return states, per_param


def time_operations(model, states, anchor_name: str, lam: float, rounds: int, timed) -> dict[str, float]:
    """Median seconds of the copy floor, an AdamW step and each plan's correction and metrics, interleaved over
    `rounds` rounds after one warm-up round, beside the KL budget's solve pass and whole step (dense plan)."""
    params = [p for p in model.parameters() if p.requires_grad]
    copies = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    optimizer = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    optimizer.step()  # allocates its state
    live = [p.detach() for p in params]
    rows: dict[str, list[float]] = {}
    dense = states["dense"]
    budget = 0.5 * dense.drift_metrics()[f"cfp/{anchor_name}/predicted_kl"]  # half the KL the AdamW steps made
    for round_ in range(rounds + 1):
        times = {"copy": timed(lambda: torch._foreach_copy_(live, copies)), "adamw": timed(optimizer.step)}
        for name, state in states.items():
            times[f"correction {name}"] = timed(lambda s=state: s.correct(lam))
            times[f"metrics {name}"] = timed(state.drift_metrics)
        # one evaluation of the KL budget's solve (replicated tensors here)
        times["budget pass dense"] = timed(lambda: dense.diagonal.budget_terms([lam]))
        times["budget step dense"] = timed(lambda: dense.correct(dense.budget_lams([budget])))
        if round_:  # the first round warms up (and compiles the fused kernels)
            for key, value in times.items():
                rows.setdefault(key, []).append(value)
    return {key: statistics.median(values) for key, values in rows.items()}


def print_memory_and_timings(per_param, median: dict[str, float]) -> None:
    print("\n| plan | beside the parameters (bytes/param) | offloaded to CPU | 7B projection beside | measured |")
    print("|---|---|---|---|---|")
    for name, (beside, offloaded, measured) in per_param.items():
        gpu = f"{measured:.3f} (cuda allocated)" if measured is not None else "n/a on CPU"
        projection = beside * PROJECTED_PARAMETERS / 1e9
        print(f"| {name} | {beside:.3f} | {offloaded:.3f} | {projection:.1f} GB | {gpu} |")
    print("\n| operation | median s | / copy | / AdamW step |")
    print("|---|---|---|---|")
    for key, value in median.items():
        print(f"| {key} | {value:.4f} | {value / median['copy']:.2f} | {value / median['adamw']:.2f} |")


def statistics_peak(threads: int) -> float:
    """Peak resident set of `fisher_statistics` as a multiple of the anchor's size, measured in a fresh process."""
    worker = subprocess.run(
        [sys.executable, __file__, "--stats-worker", "--threads", str(threads)],
        capture_output=True,
        text=True,
        check=True,
    )
    anchor_bytes, extra_peak, concentration_peak = (int(v) for v in worker.stdout.split()[-3:])
    print(
        f"\nstatistics: anchor {anchor_bytes / 1e6:.0f} MB; peak resident set rises {extra_peak / 1e6:.0f} MB during "
        f"fisher_statistics, {concentration_peak / 1e6:.0f} MB during concentration"
    )
    return (anchor_bytes + extra_peak) / anchor_bytes


def bandwidth_floors(median: dict[str, float], numel: int) -> dict[str, float]:
    """Each pass's floor in seconds: the bytes it must move per parameter at the copy's measured bandwidth.

    Bytes per parameter (bf16): copy reads and writes it (2 + 2); the dense correction reads the parameter and
    theta0 (2 + 2) and F (4; 2 with bf16 F) and writes the parameter (2); the sparse one, per kept coordinate, its
    index (4), theta0 (2), F (4), and the parameter read and written (2 + 2)."""
    moved = {"copy": 4, "correction dense": 10, "correction bf16f": 8, "correction sparse": 14 * 0.01}
    bandwidth = 4 * numel / median["copy"]
    floors = {k: b * numel / bandwidth for k, b in moved.items()}
    print("\n| pass | bytes / param | floor s (at the copy's bandwidth) | measured / floor |\n|---|---|---|---|")
    for key, seconds in floors.items():
        print(f"| {key} | {moved[key]:g} | {seconds:.4f} | {median[key] / seconds:.2f} |")
    print(
        "BANDWIDTH "
        + " ".join(f"{k.replace(' ', '_')}={b * numel / median[k] / 1e9:.1f}GB/s" for k, b in moved.items())
    )
    return floors


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds after one warm-up round")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=1000, help="steps of the bf16-F error experiment")
    parser.add_argument("--stats-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.stats_worker:
        return stats_worker()

    device = torch.device(args.device)
    model = smollm2_135m_shaped().to(device, torch.bfloat16)
    anchor = synthetic_anchor(model)
    lam = 1.0 / anchor.metadata["statistics"]["p99"]
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"{numel:,} parameters (bf16) on {device}, {args.threads} threads, lam = 1/p99 = {lam:.4g}")

    states, per_param = bind_plans(model, anchor, numel)
    median = time_operations(model, states, anchor.name, lam, args.rounds, synchronized(device))
    print_memory_and_timings(per_param, median)
    path_error, sensitive_error = bf16_fisher_error(args.steps)
    print(
        f"\nF in bf16 after {args.steps} steps: the path differs from float32 F's by {path_error:.2e} of its drift; "
        f"sum F Delta^2 by {sensitive_error:.2e} (relative)"
    )
    stats_peak = statistics_peak(args.threads)
    floors = bandwidth_floors(median, numel)
    result = {
        "correction_vs_floor": median["correction dense"] / floors["correction dense"],
        "bf16f_correction_vs_floor": median["correction bf16f"] / floors["correction bf16f"],
        "budget_pass_vs_correction": median["budget pass dense"] / median["correction dense"],
        "budget_step_vs_correction": median["budget step dense"] / median["correction dense"],
        "correction_vs_copy": median["correction dense"] / median["copy"],
        "metrics_vs_correction": median["metrics dense"] / median["correction dense"],
        "dense_bytes_per_param": per_param["dense"][0],
        "bf16f_bytes_per_param": per_param["bf16f"][0],
        "sparse_bytes_per_param": per_param["sparse"][0],
        "stats_peak_vs_anchor": stats_peak,
    }
    print("RESULT " + " ".join(f"{k}={v:.3g}" for k, v in result.items()))


if __name__ == "__main__":
    main()
