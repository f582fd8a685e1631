"""Benchmark the LoRA correction and the drift metrics against a plain LoRA optimizer step, side by side.

Model: a SmolLM2-135M-shaped Llama built from config with random weights (hidden 576, 30 layers, 9 heads,
3 kv heads, intermediate 1536, vocab 49152, tied embeddings; nothing is downloaded) with LoRA r=16 on
q, k, v, o, gate, up and down projections (210 adapted weights). Anchor: a synthetic one, a random
heavy-tailed F over every base weight, lam = 1 / p99 of F.

Each round, interleaved, times:
  step        forward + backward + AdamW step of the LoRA factors on a batch of B x T random tokens
  <rule>      CFPState.correct(lam) with that LoRA rule (proximal_b, least_squares_b, factor_space); the
              factors are restored afterwards, so every rule corrects the same proposal
  +residual   CFPState.correct(lam, measure_residual=True) with proximal_b (what a logging step costs)
  metrics     one CFPState.drift_metrics() (base-space sensitive / free / total drift)
and the table gives the medians over rounds and their ratios to the step. The last line is machine-readable:

  RESULT peft_correction_vs_step=<x> peft_metrics_vs_step=<y>

(x: the default rule, proximal_b, without the residual; y: one drift_metrics() call).

    python scripts/bench_peft.py [--batch 4] [--seq 256] [--rounds 5] [--threads 2]
"""

import argparse
import statistics
import time

import torch

RULES = ("proximal_b", "least_squares_b", "factor_space")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def smollm2_135m_shaped(seed: int = 0):
    """SmolLM2-135M's architecture from config, random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=2048,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def synthetic_anchor(model, seed: int = 1):
    """A random, heavy-tailed F (log-normal) over every base weight of `model`."""
    from hf_cfp import FisherAnchor

    g = torch.Generator().manual_seed(seed)
    fisher = {n: (2.0 * torch.randn(p.shape, generator=g)).exp() * 1e-3 for n, p in model.named_parameters()}
    return FisherAnchor(fisher, name="synthetic")


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


COLUMNS = ["step", *RULES, "+residual", "metrics"]
LABELS = {"step": "step (fwd+bwd+AdamW)", "+residual": "proximal_b + residual", "metrics": "drift_metrics()"}


def time_rounds(model, states, lam: float, batch: int, seq: int, rounds: int) -> dict[str, list[float]]:
    """Per round after one warm-up round, the seconds of a LoRA step and of each rule's correction (undone after
    timing), proximal_b with its residual measured, and the drift metrics."""
    factors = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(factors, lr=1e-4)
    ids = torch.randint(0, 49152, (batch, seq), generator=torch.Generator().manual_seed(0))

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def corrected(rule: str, measure: bool = False):
        saved = [p.detach().clone() for p in factors]
        seconds = timed(lambda: states[rule].correct(lam, measure_residual=measure))
        with torch.no_grad():
            torch._foreach_copy_(factors, saved)
        return seconds

    times: dict[str, list[float]] = {c: [] for c in COLUMNS}
    for round_ in range(rounds + 1):
        row = {"step": timed(step)}
        for rule in RULES:
            row[rule] = corrected(rule)
        row["+residual"] = corrected("proximal_b", measure=True)
        row["metrics"] = timed(states["proximal_b"].drift_metrics)
        if round_ > 0:  # round 0 warms up
            for c in COLUMNS:
                times[c].append(row[c])
        print(f"round {round_}: " + " ".join(f"{c}={row[c]:.3f}s" for c in COLUMNS), flush=True)
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds after one warm-up round")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    from peft import LoraConfig, get_peft_model

    from hf_cfp.protection import CFPState

    torch.set_num_threads(args.threads)
    base = smollm2_135m_shaped()
    anchor = synthetic_anchor(base)
    lam = 1.0 / anchor.metadata["statistics"]["p99"]
    model = get_peft_model(base, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=TARGETS))
    states = {rule: CFPState(model, anchor, lora_rule=rule) for rule in RULES}
    times = time_rounds(model, states, lam, args.batch, args.seq, args.rounds)

    adapted = len(states["proximal_b"].adapters.weights)
    lora_parameters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(
        f"\nSmolLM2-135M-shaped Llama (random weights), LoRA r={args.rank} on {', '.join(TARGETS)} "
        f"({adapted} adapted weights, {lora_parameters:,} LoRA parameters), "
        f"batch {args.batch} x {args.seq} tokens, {args.threads} threads, lam = 1/p99 = {lam:.3g}; "
        f"medians of {args.rounds} rounds"
    )
    medians = {c: statistics.median(v) for c, v in times.items()}
    print(f"{'':>22} | {'median s':>9} | {'/ step':>7}")
    for c in COLUMNS:
        print(f"{LABELS.get(c, c):>22} | {medians[c]:>9.3f} | {medians[c] / medians['step']:>7.3f}")
    print(
        "RESULT "
        f"peft_correction_vs_step={medians['proximal_b'] / medians['step']:.3g} "
        f"peft_metrics_vs_step={medians['metrics'] / medians['step']:.3g} "
        + " ".join(f"{rule}_vs_step={medians[rule] / medians['step']:.3g}" for rule in RULES)
    )


if __name__ == "__main__":
    main()
