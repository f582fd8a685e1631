"""Benchmark the KL budget's per-step solve against a fixed-lam correction and a full-parameter AdamW step.

Model: the SmolLM2-135M-shaped Llama of bench_peft.py (random weights, built from config) with its synthetic
heavy-tailed anchor; full-parameter AdamW at lr 1e-4. Two unprotected steps set the scene; the budget is then
half the predicted KL reached, so it binds at every timed step. Each round, interleaved, times:

  step        forward + backward + AdamW step on a batch of B x T random tokens
  fixed lam   CFPState.correct(lam), lam = 1/p99 (1 + lam F recomputed from F a chunk at a time)
  new lam     CFPState.correct(lam') with a lam' not seen before (the same work: nothing is cached per lam)
  budget      CFPState.budget_lams(B) (warm-started from the previous step) + correct(lams)

Every correction is undone after timing except the budget's, which the path keeps. The table gives medians
and ratios to the step, and the number of passes over the parameters the solve took. Last line:

  RESULT budget_vs_step=<x> budget_vs_fixed_lam=<y> budget_passes=<n>

    python scripts/bench_budget.py [--batch 2] [--seq 128] [--rounds 5] [--threads 2]
"""

import argparse
import contextlib
import statistics
from unittest import mock

import torch
from bench_peft import smollm2_135m_shaped, synthetic_anchor, timed  # scripts/ is on sys.path when run

COLUMNS = ["step", "fixed lam", "new lam", "budget"]


@contextlib.contextmanager
def counting_budget_passes():
    """Count the solve's passes over the parameters while inside: yields a list whose last entry counts (the caller
    appends a 0 to start each count).

    Each evaluation of the solve makes 2 passes (the replicated and the sharded part, the latter empty here)."""
    from hf_cfp.protection import diagonal as diagonal_module

    passes: list[int] = []
    original = diagonal_module.budget_terms

    def counted(*args, **kwargs):
        passes[-1] += 1
        return original(*args, **kwargs)

    with mock.patch.object(diagonal_module, "budget_terms", counted):
        yield passes


def time_rounds(model, anchor, batch: int, seq: int, rounds: int, passes: list[int]):
    """Per round (the first a warm-up), the seconds of each column; returns (times per column, budget in nats)."""
    from hf_cfp.protection import CFPState

    lam = 1.0 / anchor.metadata["statistics"]["p99"]
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    state = CFPState(model, anchor)  # the budget's path
    fixed = CFPState(model, anchor)  # a fixed lam
    ids = torch.randint(0, 49152, (batch, seq), generator=torch.Generator().manual_seed(0))

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def undone(fn) -> float:
        saved = [p.detach().clone() for p in params]
        seconds = timed(fn)
        with torch.no_grad():
            torch._foreach_copy_(params, saved)
        return seconds

    for _ in range(2):
        step()
    budget = 0.5 * state.drift_metrics()["cfp/synthetic/predicted_kl"]
    times: dict[str, list[float]] = {c: [] for c in COLUMNS}
    for round_ in range(rounds + 1):
        row = {"step": timed(step)}
        row["fixed lam"] = undone(lambda: fixed.correct(lam))
        row["new lam"] = undone(lambda r=round_: state.correct(lam * (1.5 + r)))  # the budget's state: no cache
        passes.append(0)
        row["budget"] = timed(lambda: state.correct(state.budget_lams([budget])))
        kl = state.drift_metrics()["cfp/synthetic/predicted_kl"]
        if round_ > 0:
            for c in COLUMNS:
                times[c].append(row[c])
        print(
            f"round {round_}: "
            + " ".join(f"{c}={row[c]:.3f}s" for c in COLUMNS)
            + f" lam_t={state.lams[0]:.4g} passes={passes[-1] // 2} predicted_kl/budget={kl / budget:.4f}",
            flush=True,
        )
    return times, budget


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds after one warm-up round")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    model = smollm2_135m_shaped()
    anchor = synthetic_anchor(model)
    with counting_budget_passes() as passes:
        times, budget = time_rounds(model, anchor, args.batch, args.seq, args.rounds, passes)
    medians = {c: statistics.median(v) for c, v in times.items()}
    evaluations = statistics.median(p // 2 for p in passes[1:])
    most = max(p // 2 for p in passes[1:])
    print(
        f"\nSmolLM2-135M-shaped Llama (random weights, {sum(p.numel() for p in model.parameters()):,} parameters), "
        f"full fine-tuning, batch {args.batch} x {args.seq}, {args.threads} threads, budget {budget:.3g} nats; "
        f"medians of {args.rounds} rounds; the solve took a median of {evaluations:g} evaluations (at most {most})"
    )
    print(f"{'':>12} | {'median s':>9} | {'/ step':>7} | {'/ fixed lam':>11}")
    for c in COLUMNS:
        m = medians[c]
        print(f"{c:>12} | {m:>9.3f} | {m / medians['step']:>7.3f} | {m / medians['fixed lam']:>11.2f}")
    print(
        f"RESULT budget_vs_step={medians['budget'] / medians['step']:.3g} "
        f"budget_vs_fixed_lam={medians['budget'] / medians['fixed lam']:.3g} budget_passes={evaluations:g}"
    )


if __name__ == "__main__":
    main()
