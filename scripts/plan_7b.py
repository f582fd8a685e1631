"""CFP at 7-8B parameters on 8 GPUs under FSDP2, on paper: bytes per rank, and the correction's traffic, FLOPs and
time per step against a bf16 training step, computed from the model's shapes (built on the meta device).

    python scripts/plan_7b.py                       # Qwen2.5-7B and Llama-3-8B shapes, the defaults below
    python scripts/plan_7b.py --ranks 8 --kfac-rank 256 --tokens-per-gpu 16384

Assumptions (flags): FSDP2 shards every parameter's first dimension over `--ranks` processes; parameters bf16;
theta0 in bf16; the accelerator's HBM bandwidth and dense bf16/TF32 peak are `--hbm-tbps` and `--bf16-tflops` /
`--tf32-tflops` (defaults: one H100 SXM), reached at `--efficiency` (elementwise and matmul work alike); a
training step is 6 P tokens FLOPs at `--mfu` of the bf16 peak. Nothing here is measured: the real figures come
from `scripts/bench_memory.py` and `scripts/bench_kfac.py` on the hardware.

Per step and rank, with P_r the parameters a rank holds:
- diagonal correction: reads theta (2), theta0 (2), F (4, or 2 in bf16) and writes theta (2) bytes per parameter;
- K-FAC correction of a weight (rows_r x in, bases truncated to r_A and r_G): D Q_A (2 rows_r in r_A FLOPs),
  Q_G^T (.) (2 rows_r r_A r_G), then back (the same again); one all-reduce of the r_G x r_A rotated block in
  float32 (a ring moves about 2 x its bytes per rank); memory: Q_A (in x r_A, replicated), the rank's rows of
  Q_G (rows_r x r_G), eigenvalues, theta0; weights with a dimension above the K-FAC limit keep a diagonal F.
"""

import argparse
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from hf_cfp.fisher.kfac_factors import MAX_DIMENSION, kfac_kind

SHAPES = {
    "Qwen2.5-7B": Qwen2Config(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
    "Llama-3-8B": LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
    ),
}
GB = 1e9


@dataclass
class Tally:
    """Per-rank sums over a model's trainable weights."""

    params: float = 0.0  # parameters held by one rank
    diagonal_params: float = 0.0  # of them, those that keep a diagonal F under a K-FAC anchor
    basis_floats: float = 0.0  # K-FAC eigenvectors and eigenvalues held by one rank
    kfac_flops: float = 0.0  # one K-FAC correction's FLOPs on one rank
    reduce_floats: float = 0.0  # the rotated blocks all-reduced per step
    owned_floats: float = 0.0  # full bases of every K-FAC weight, to be divided among ranks that own whole weights


def tally(name: str, ranks: int, kfac_rank: int | None) -> Tally:
    """Walk the model's Linear weights and other parameters (meta device: no memory is used)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(SHAPES[name])
    counted = Tally()
    kfac_weights = set()
    for module in model.modules():
        if kfac_kind(module) is None:
            continue
        out_dim, in_dim = module.weight.shape
        kfac_weights.add(id(module.weight))
        rows = out_dim / ranks
        r_a, r_g = min(kfac_rank or in_dim, in_dim), min(kfac_rank or out_dim, out_dim)
        counted.basis_floats += in_dim * r_a + r_a + rows * r_g + r_g
        counted.kfac_flops += 2 * (2 * rows * in_dim * r_a + 2 * rows * r_a * r_g)
        counted.reduce_floats += r_g * r_a
        counted.owned_floats += (in_dim * r_a + r_a + out_dim * r_g + r_g) / ranks
    for p in model.parameters():
        counted.params += p.numel() / ranks
        if id(p) not in kfac_weights:
            counted.diagonal_params += p.numel() / ranks
    return counted


def report(name: str, args: argparse.Namespace) -> None:
    full, truncated = tally(name, args.ranks, None), tally(name, args.ranks, args.kfac_rank)
    params = full.params
    step_s = 6 * params * args.ranks * args.tokens_per_gpu / args.ranks / (args.mfu * args.bf16_tflops * 1e12)
    bandwidth = args.hbm_tbps * 1e12 * args.efficiency
    print(f"\n## {name}: {params * args.ranks / 1e9:.2f} B parameters, {params / 1e9:.3f} B per rank of {args.ranks}")
    print(f"bf16 training step (6 P x {args.tokens_per_gpu} tokens per GPU at {args.mfu:.0%} MFU): {step_s:.2f} s\n")
    print("| plan | CFP bytes per rank | correction per step | time per step | / training step |")
    print("|---|---|---|---|---|")
    for label, per_param, traffic in (("diagonal, F float32", 6, 10), ("diagonal, F bfloat16", 4, 8)):
        seconds = traffic * params / bandwidth
        print(
            f"| {label} | {per_param * params / GB:.1f} GB | {traffic * params / GB:.1f} GB moved | "
            f"{seconds * 1e3:.1f} ms | {seconds / step_s:.2%} |"
        )
    for label, counted in (
        (f"K-FAC, full rank (dimensions <= {MAX_DIMENSION})", full),
        (f"K-FAC, kfac_rank={args.kfac_rank}", truncated),
    ):
        memory = 2 * params + 4 * counted.basis_floats + 4 * counted.diagonal_params
        seconds = counted.kfac_flops / (args.tf32_tflops * 1e12 * args.efficiency)
        seconds += 10 * counted.diagonal_params / bandwidth
        communication = 2 * 4 * counted.reduce_floats
        print(
            f"| {label} | {memory / GB:.1f} GB | {counted.kfac_flops / 1e12:.1f} TFLOP + "
            f"{communication / GB:.2f} GB all-reduced | {seconds * 1e3:.1f} ms + comm. | {seconds / step_s:.2%} |"
        )
    kfac_params = params - full.diagonal_params
    memory = 2 * params + 4 * full.owned_floats + 4 * full.diagonal_params
    seconds = full.kfac_flops / (args.tf32_tflops * 1e12 * args.efficiency) + 10 * full.diagonal_params / bandwidth
    print(
        f"| K-FAC, full rank, each weight corrected by one owning rank (not implemented) | {memory / GB:.1f} GB | "
        f"{full.kfac_flops / 1e12:.1f} TFLOP + {2 * 2 * kfac_params / GB:.2f} GB gathered and scattered back | "
        f"{seconds * 1e3:.1f} ms + comm. | {seconds / step_s:.2%} |"
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--kfac-rank", type=int, default=256, help="eigenpairs kept per factor in the truncated row")
    parser.add_argument("--tokens-per-gpu", type=int, default=16384, help="tokens per optimizer step per GPU")
    parser.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilization of the training step")
    parser.add_argument("--bf16-tflops", type=float, default=989.0, help="dense bf16 peak (H100 SXM)")
    parser.add_argument("--tf32-tflops", type=float, default=495.0, help="dense TF32 peak (H100 SXM)")
    parser.add_argument("--hbm-tbps", type=float, default=3.35, help="HBM bandwidth, TB/s (H100 SXM)")
    parser.add_argument("--efficiency", type=float, default=0.7, help="share of peak the correction reaches")
    args = parser.parse_args(argv)
    for name in SHAPES:
        report(name, args)


if __name__ == "__main__":
    main()
