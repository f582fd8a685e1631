"""CFP at 7-70B parameters on 8 GPUs under FSDP2, DDP, FSDP1 and DeepSpeed ZeRO-3, on paper: bytes per rank, and
the correction's FLOPs, memory traffic, communicated bytes and time per step against a bf16 training step, computed
from the models' shapes (built on the meta device).

    python scripts/plan_7b.py                       # Qwen2.5-7B, Llama-3-8B and Llama-3-70B, the defaults below
    python scripts/plan_7b.py --ranks 8 --kfac-rank 128 --tokens-per-gpu 16384

Which weights are factored is the library's rule (`geometry.kronecker.sink.kfac_weights`): every 2-D Linear weight,
whatever its width, an untied vocabulary-sized lm_head included; a tied lm_head (an embedding lookup too), the
embeddings and the 1-D parameters keep a diagonal F. A factor wider than `MAX_FORMED_DIMENSION` is sketched at
estimation, never formed. Rows: `--kfac-rank` R (default 256: the rank the sweep of `scripts/reproduce_table.py`
recommends where full rank does not fit, `docs/guides/kfac.md`) with tails (the mean of the eigenvalues left out,
`geometry.kronecker.basis`); and, for comparison, what `kfac_rank=None` keeps: formed factors at full rank (no tail),
sketched ones at `WIDE_RANK` eigenpairs with a tail.

Assumptions (flags): parameters and theta0 bf16; the bound eigenvectors in the weights' dtype (bf16), eigenvalues
and tails float32; the diagonal F of the rest float32; the accelerator's HBM bandwidth and dense bf16 peak are
`--hbm-tbps` and `--bf16-tflops` (defaults: one H100 SXM), reached at `--efficiency`; a collective's bus
bandwidth is `--link-gbps`; a ring all-reduce of B bytes moves 2 (n - 1) / n B per rank. A training step is 6 P
tokens FLOPs at `--mfu` of the bf16 peak. Time = FLOPs at the peak + memory traffic at the HBM bandwidth +
communication at the bus bandwidth (no overlap: an upper bound). Nothing here is measured: the real figures come
from `scripts/bench_memory.py` and `scripts/bench_kfac.py` on the hardware.

Per weight W (rows x in held by the process that corrects it; rows = out / n row-sharded under FSDP2, out whole
under DDP), bases cut to r_A and r_G eigenpairs (`geometry.kronecker.basis` states the math):
- FLOPs, with a tail: M = D U_A (2 rows in r_A), P = U_G^T M (2 r_G rows r_A), N = U_G^T D (2 r_G rows in), the
  core (r_G x r_A) times U_A^T (2 r_G r_A in), the fused product [U_G, M'] [N'; U_A^T] (2 rows in (r_G + r_A));
  without a tail (both factors full): D U_A, U_G^T (.), and back (2 (2 rows in r_A + 2 rows r_A r_G)).
- Memory traffic: `TAILED_BYTES` (without a tail `UNTAILED_BYTES`) per parameter corrected, counted from the
  passes of `geometry.kronecker.state` and `geometry.kronecker.basis` over bf16 weights: the projection forms D in
  bf16 (theta and theta0 read, D written: 6), its two products read D (4), |D|^2 reads a float32 copy of it (10); the
  correction of each weight in place makes the weight and theta0 float32 (12), lerps (12), adds the bf16 product
  through a float32 copy (2 + 6 + 12) and writes the weight back (6): about 70 bytes. Without a tail: D (6), one read
  by the product (2), then the product's 32: about 40. The diagonal F of the rest: 10 bytes per parameter (theta 2 +
  theta0 2 + F 4 read, theta 2 written).
- Temporaries: `TEMPORARY_BYTES` per parameter of the largest batch (`geometry.kronecker.state.BATCH` weights of one
  shape): D in bf16 and the float32 copy the norm reads; the float32 temporaries of the one weight being corrected
  add under 2 bytes per parameter of a batch of 8.
- FSDP2 (row shards): every rank corrects its rows of every weight; P (r_G x r_A), with a tail N (r_G x in) too,
  float32, and the norms (r_A + 1, float64) are all-reduced per weight and step. Memory: theta0 of the rank's
  rows, U_A whole (every rank), the rank's rows of U_G.
- DDP (replicated weights): batches of like weights, each corrected by one owning process (largest first to the
  least loaded, by FLOPs, as `geometry.kronecker.state` assigns them); the busiest process sets the time. The corrected
  values reach the others in one all-reduce per step of the factored weights' bf16 values (zeros from the
  non-owners: 2 bytes per factored parameter; an all-gather would move half as many bytes per rank); every
  process stacks and writes back the weights it does not own (10 bytes per parameter). Memory: theta0, the bases
  and F of the whole model on every process.
- FSDP1 and ZeRO-3 (flat pieces, `geometry.kronecker.pieces`): every rank holds 1/n of each weight's flattened
  elements, cut anywhere, and corrects them on the rows they touch (out / n + 1); P, with a tail N and the whole M
  (out x r_A) too, float32, and |D|^2 (float64) are all-reduced per weight and step. ZeRO-3 also corrects its fp32
  master partitions (`geometry.kronecker.master`), twice the work and communication. Two summed anchors are refused
  on flat pieces (no row). Memory: as FSDP2.
- Two summed anchors (`summed`, `block_flops`): the exact proximal map of their summed penalty by the blocks of
  their pooled eigenvectors, in float64 at `--fp64-tflops`, with the conjugate-gradient iterations per weight that
  `scripts/bench_kfac.py` measured on the embedded model (`--iterations`). Its small blocks (m x m, m = 2 R at
  these widths) are solved alike on every FSDP2 rank, and by each weight's owner under DDP.
"""

import argparse
from dataclasses import dataclass, field, replace
from functools import partial

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from hf_cfp.fisher.feeding import scored_parameters
from hf_cfp.geometry.kronecker import kfac_weights
from hf_cfp.geometry.kronecker.factors import MAX_FORMED_DIMENSION, WIDE_RANK
from hf_cfp.geometry.kronecker.state import BATCH, balanced_owners

# Conjugate-gradient iterations per weight of two summed rank-256 anchors at a realistic step, measured on the
# embedded model by `scripts/bench_kfac.py` (kfac_two_anchor_iterations; docs/reports/performance.md).
ITERATIONS = 101.0

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
    "Llama-3-70B": LlamaConfig(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
    ),
}
GB = 1e9
TAILED_BYTES = 70  # HBM bytes per parameter of the tailed correction (module docstring)
UNTAILED_BYTES = 40  # the same without a tail
TEMPORARY_BYTES = 8  # live temporaries per parameter of the batch being corrected
DIAGONAL_BYTES = 10  # the diagonal correction: theta, theta0, F (float32) read, theta written
SUMMED_BYTES = 104  # the summed map per parameter: D float64 formed (4 + 8) and read twice (16), X written (8 + 8)
# and updated three times (48), theta0 read and the weight written (12)


@dataclass(frozen=True)
class Weight:
    """A factored weight, out x in, with the eigenpairs its bases keep."""

    name: str
    out_dim: int
    in_dim: int
    r_a: int
    r_g: int

    @property
    def tailed(self) -> bool:
        return self.r_a < self.in_dim or self.r_g < self.out_dim

    @property
    def params(self) -> int:
        return self.out_dim * self.in_dim

    def flops(self, rows: float) -> float:
        """One correction of `rows` of this weight (module docstring)."""
        i, r_a, r_g = self.in_dim, self.r_a, self.r_g
        if not self.tailed:
            return 2 * (2 * rows * i * r_a + 2 * rows * r_a * r_g)
        return (
            2 * rows * i * r_a
            + 2 * r_g * rows * r_a
            + 2 * r_g * rows * i
            + 2 * r_g * r_a * i
            + 2 * rows * i * (r_g + r_a)
        )

    def traffic(self, rows: float) -> float:
        """HBM bytes of one correction of `rows` of this weight."""
        return (TAILED_BYTES if self.tailed else UNTAILED_BYTES) * rows * self.in_dim

    def basis_bytes(self, rows: float) -> float:
        """The bound basis on a process that holds `rows` of U_G: bf16 eigenvectors, float32 eigenvalues and tails."""
        return 2 * (self.in_dim * self.r_a + rows * self.r_g) + 4 * (self.r_a + self.r_g + 2 * self.tailed)

    def stored_floats(self) -> int:
        """Floats in the anchor file: U_A, U_G, the eigenvalues, and the tails when truncated."""
        return (self.in_dim + 1) * self.r_a + (self.out_dim + 1) * self.r_g + 2 * self.tailed

    def reduced_bytes(self) -> float:
        """What FSDP2's row shards all-reduce per step: P, with a tail N and the norms."""
        if not self.tailed:
            return 4 * self.r_g * self.r_a
        return 4 * (self.r_g * self.r_a + self.r_g * self.in_dim) + 8 * (self.r_a + 1)

    def piece_reduced_bytes(self) -> float:
        """What flat pieces (FSDP1, ZeRO-3) all-reduce per step: P, with a tail N, the whole M and |D|^2."""
        if not self.tailed:
            return 4 * self.r_g * self.r_a
        return 4 * (self.r_g * self.r_a + self.r_g * self.in_dim + self.out_dim * self.r_a) + 8


@dataclass
class Model:
    """A model's parameters, as the plan sees them."""

    name: str
    params: int
    diagonal: dict[str, int]  # name -> size, the parameters with a diagonal F
    linear_diagonal: list[str]  # 2-D Linear weights left diagonal (a tied lm_head); none for its width
    shapes: list[tuple[str, int, int]] = field(default_factory=list)  # the factored weights: name, out, in

    def weights(self, kfac_rank: int | None) -> list[Weight]:
        """The factored weights with the eigenpairs an estimate with `kfac_rank` keeps (None: all of a formed
        factor, `WIDE_RANK` of a sketched one)."""

        def kept(dim: int) -> int:
            if kfac_rank is None:
                return dim if dim <= MAX_FORMED_DIMENSION else min(WIDE_RANK, dim)
            return min(kfac_rank, dim)

        return [Weight(name, out, i, kept(i), kept(out)) for name, out, i in self.shapes]


def load(name: str) -> Model:
    """The model's shapes (meta device: no memory is used)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(SHAPES[name])
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    factored = {s.name for s in kfac_weights(scored_parameters(model, named))}
    shapes = [(n, *p.shape) for n, p in named if n in factored]
    diagonal = {n: p.numel() for n, p in named if n not in factored}
    linear_diagonal = [
        n
        for module_name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
        for n in [f"{module_name}.weight"]
        if n not in factored
    ]
    params = sum(p.numel() for _, p in named)
    return Model(name, params, diagonal, linear_diagonal, shapes)


def batches(weights: list[Weight]) -> list[list[Weight]]:
    """Like weights (shape and ranks) in batches of up to BATCH, in the model's order (as
    `geometry.kronecker.state`)."""
    kinds: dict[tuple, list[Weight]] = {}
    for w in weights:
        kinds.setdefault((w.out_dim, w.in_dim, w.r_a, w.r_g), []).append(w)
    return [same[i : i + BATCH] for same in kinds.values() for i in range(0, len(same), BATCH)]


@dataclass
class Cost:
    """One plan's figures per rank and step (the busiest rank)."""

    theta0: float  # bytes
    bases: float  # bytes
    fisher: float  # bytes, the diagonal F of the rest
    temporaries: float  # bytes, the largest batch's
    flops: float
    traffic: float  # HBM bytes
    communicated: float  # bytes sent and received by one rank
    float64_flops: float = 0.0  # the summed proximal map's, at the float64 peak

    @property
    def memory(self) -> float:
        return self.theta0 + self.bases + self.fisher

    def seconds(self, args: argparse.Namespace) -> tuple[float, float]:
        """(compute and memory time, communication time)."""
        compute = self.flops / (args.bf16_tflops * 1e12 * args.efficiency)
        compute += self.float64_flops / (args.fp64_tflops * 1e12 * args.efficiency)
        compute += self.traffic / (args.hbm_tbps * 1e12 * args.efficiency)
        return compute, self.communicated / (args.link_gbps * 1e9)


def fsdp2(model: Model, weights: list[Weight], n: int) -> Cost:
    diagonal = sum(model.diagonal.values())
    ring = 2 * (n - 1) / n
    return Cost(
        theta0=2 * model.params / n,
        bases=sum(w.basis_bytes(w.out_dim / n) for w in weights),
        fisher=4 * diagonal / n,
        temporaries=max(TEMPORARY_BYTES * sum(w.params for w in b) / n for b in batches(weights)),
        flops=sum(w.flops(w.out_dim / n) for w in weights),
        traffic=sum(w.traffic(w.out_dim / n) for w in weights) + DIAGONAL_BYTES * diagonal / n,
        communicated=ring * sum(w.reduced_bytes() for w in weights),
    )


def ddp(model: Model, weights: list[Weight], n: int) -> Cost:
    groups = batches(weights)
    costs = [sum(w.flops(w.out_dim) for w in b) for b in groups]
    owner = balanced_owners(costs, n)
    busiest = max(range(n), key=lambda p: sum(c for c, o in zip(costs, owner, strict=True) if o == p))
    owned = [b for b, o in zip(groups, owner, strict=True) if o == busiest]
    factored = sum(w.params for w in weights)
    owned_params = sum(w.params for b in owned for w in b)
    diagonal = sum(model.diagonal.values())
    return Cost(
        theta0=2 * model.params,
        bases=sum(w.basis_bytes(w.out_dim) for w in weights),
        fisher=4 * diagonal,
        temporaries=max(TEMPORARY_BYTES * sum(w.params for w in b) for b in groups),
        flops=sum(w.flops(w.out_dim) for b in owned for w in b),
        traffic=sum(w.traffic(w.out_dim) for b in owned for w in b)
        + 10 * (factored - owned_params)
        + DIAGONAL_BYTES * diagonal,
        communicated=2 * (n - 1) / n * 2 * factored,
    )


def flat(model: Model, weights: list[Weight], n: int, master: bool) -> Cost:
    """FSDP1 and ZeRO-3: each rank holds 1/n of every weight's flattened elements, laid into about out/n + 1 rows,
    and corrects them from the complete projection; the temporaries add the complete M (out x r_A, float32) of the
    widest weight. ZeRO-3 (`master`) corrects its fp32 master partitions the same way: twice the FLOPs, traffic and
    communication, nothing more held (views of DeepSpeed's partitions)."""
    diagonal = sum(model.diagonal.values())
    times = 2 if master else 1
    ring = 2 * (n - 1) / n
    return Cost(
        theta0=2 * model.params / n,
        bases=sum(w.basis_bytes(w.out_dim / n + 1) for w in weights),
        fisher=4 * diagonal / n,
        temporaries=max(TEMPORARY_BYTES * (w.out_dim / n + 1) * w.in_dim + 4 * w.out_dim * w.r_a for w in weights),
        flops=times * sum(w.flops(w.out_dim / n + 1) for w in weights),
        traffic=times * (sum(w.traffic(w.out_dim / n + 1) for w in weights) + DIAGONAL_BYTES * diagonal / n),
        communicated=times * ring * sum(w.piece_reduced_bytes() for w in weights),
    )


def block_flops(w: Weight, rows: float, anchors: int, iterations: float) -> float:
    """Float64 FLOPs of the summed proximal map of `anchors` K-FAC anchors on `rows` of w, by the blocks of their
    pooled eigenvectors (`geometry.kronecker.summed_blocks`), m = min(width, K r) pooled directions a side: the
    products with D (Q_L^T D, D Q_R, the blocks mapped back: 5 rows in m + 2 m^2 in multiply-adds, the two small
    solves' 2 m^2 in more), the orthonormal bases and their coordinates (two Gram passes and Q^T U: 5 (rows + in) m^2)
    and the small factors (K m^2 (r_G + r_A)), two Cholesky factorizations and two eigendecompositions (about 20
    m^3), and (2 K + 4) m^3 per conjugate-gradient iteration and at the start."""
    m = max(min(w.out_dim, anchors * w.r_g), min(w.in_dim, anchors * w.r_a))
    products = 5 * rows * w.in_dim * m + 4 * m * m * w.in_dim
    bases = 5 * (rows + w.in_dim) * m * m + anchors * m * m * (w.r_g + w.r_a)
    small = (20 + (iterations + 1) * (2 * anchors + 4)) * m**3
    return 2 * (products + bases + small)


def summed(cost: Cost, weights: list[Weight], rows_of, anchors: int, iterations: float, n: int, sharded: bool) -> Cost:
    """`cost` of one anchor's closed form with the summed proximal map of `anchors` K-FAC anchors added on every
    factored weight (`block_flops`; the closed form's FLOPs, traffic and reduces kept as an upper bound for the
    passes around it): under FSDP2 every rank solves its rows of every weight (the small blocks alike on each), under
    DDP each weight by one owner (the work split evenly); `SUMMED_BYTES` of HBM traffic per parameter solved; under
    row shards Q_L^T D (m x in), two Gram matrices and the coordinates Q_L^T U_G (float64) all-reduced per weight; K
    anchors' bases; the solve's temporaries, D and X float64 of the largest weight."""
    share = 1 if sharded else n
    reduced = sum(
        8 * (m * w.in_dim + 2 * m * m + m * anchors * w.r_g)
        for w in weights
        for m in [min(w.out_dim, anchors * w.r_g)]
    )
    largest = max(rows_of(w) * w.in_dim for w in weights)
    return replace(
        cost,
        bases=anchors * cost.bases,
        temporaries=cost.temporaries + 16 * largest,
        float64_flops=sum(block_flops(w, rows_of(w), anchors, iterations) for w in weights) / share,
        traffic=cost.traffic + SUMMED_BYTES * sum(rows_of(w) * w.in_dim for w in weights) / share,
        communicated=cost.communicated + (2 * (n - 1) / n * reduced if sharded else 0.0),
    )


def describe_layout(model, ranked, full, r: int) -> None:
    """Which weights are factored, which keep a diagonal F, which are sketched at estimation, and the floats stored
    per factored parameter at rank `r` and at full rank."""
    factored = sum(w.params for w in ranked)
    diagonal = sum(model.diagonal.values())
    wide = sorted(
        {
            f"{w.name.split('.')[-2]} {which} ({dim})"
            for w in ranked
            for which, dim in (("A", w.in_dim), ("G", w.out_dim))
            if dim > MAX_FORMED_DIMENSION
        }
    )
    kinds = sorted({".".join(k.split(".")[-2:]) for k in model.diagonal})  # e.g. embed_tokens.weight
    print(
        f"factored: {len(ranked)} weights, {factored / 1e9:.2f} B parameters ({factored / model.params:.1%}); "
        f"diagonal F: {diagonal / 1e9:.2f} B ({', '.join(kinds)}); "
        f"sketched at estimation (wider than {MAX_FORMED_DIMENSION}): {', '.join(wide) or 'none'}"
    )
    left = ", ".join(model.linear_diagonal) or "none"
    print(
        f"Linear weights with a diagonal F: {left}. No layer stays diagonal for its width: every 2-D Linear weight "
        "is factored, an untied lm_head included (by rule only a tied lm_head, an embedding lookup too, keeps its "
        f"diagonal F). Stored at rank {r}: {sum(w.stored_floats() for w in ranked) / factored:.4f} floats per "
        f"factored parameter (kfac_rank=None: {sum(w.stored_floats() for w in full) / factored:.2f})\n"
    )


def diagonal_rows(model: Model, step_s: float, args: argparse.Namespace) -> None:
    """The FSDP2 rows of a diagonal anchor: theta0 (bf16) and F per rank, (6 + bytes of F) x P / n of HBM traffic."""
    n = args.ranks
    for label, f_bytes in (("FSDP2, diagonal anchor, F float32", 4), ("FSDP2, diagonal anchor, F bfloat16", 2)):
        seconds = (6 + f_bytes) * model.params / n / (args.hbm_tbps * 1e12 * args.efficiency)
        memory = (2 + f_bytes) * model.params / n
        print(
            f"| {label} | {2 * model.params / n / GB:.1f} GB | - | {f_bytes * model.params / n / GB:.1f} GB "
            f"| {memory / GB:.1f} GB | - | - | {(6 + f_bytes) * model.params / n / GB:.1f} GB | - "
            f"| {seconds * 1e3:.1f} ms | {seconds / step_s:.2%} |"
        )


def kfac_row(label: str, plan: str, cost: Cost, model: Model, step_s: float, args: argparse.Namespace) -> dict:
    """Print one K-FAC plan's table row and return its RESULT figures (per rank: GB, TFLOP, GB sent, step share)."""
    n = args.ranks
    compute, comm = cost.seconds(args)
    share = (compute + comm) / step_s
    weights_bytes = 2 * model.params / (1 if plan == "ddp" else n)  # the rank's bf16 weights
    over = cost.memory + weights_bytes > args.hbm_gb * GB
    fits = f" (with the weights' {weights_bytes / GB:.0f} GB: over HBM)" if over else ""
    fp64 = f" + {cost.float64_flops / 1e12:.2f} float64" if cost.float64_flops else ""
    print(
        f"| {plan.upper()}, {label}{fits} | {cost.theta0 / GB:.1f} GB | {cost.bases / GB:.2f} GB "
        f"| {cost.fisher / GB:.2f} GB | {cost.memory / GB:.1f} GB | {cost.temporaries / GB:.1f} GB "
        f"| {cost.flops / 1e12:.2f} TFLOP{fp64} | {cost.traffic / GB:.1f} GB "
        f"| {cost.communicated / GB:.2f} GB "
        f"| {compute * 1e3:.1f} + {comm * 1e3:.1f} ms | {share:.2%} |"
    )
    return {
        "gb_per_rank": cost.memory / GB,
        "tflop_per_rank": (cost.flops + cost.float64_flops) / 1e12,
        "comm_gb_per_rank": cost.communicated / GB,
        "step_share": share,
    }


def report(name: str, args: argparse.Namespace) -> None:
    model, n, r = load(name), args.ranks, args.kfac_rank
    step_s = 6 * model.params * args.tokens_per_gpu / (args.mfu * args.bf16_tflops * 1e12)
    ranked, full = model.weights(r), model.weights(None)
    factored = sum(w.params for w in ranked)
    print(f"\n## {name}: {model.params / 1e9:.2f} B parameters on {n} GPUs")
    print(f"bf16 training step (6 P x {args.tokens_per_gpu} tokens per GPU at {args.mfu:.0%} MFU): {step_s:.2f} s")
    describe_layout(model, ranked, full, r)
    print(
        "| plan | theta0 | bases | diagonal F | CFP bytes per rank | temporaries | correction FLOPs | HBM traffic "
        "| communicated per rank | time per step | / training step |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    diagonal_rows(model, step_s, args)
    results = {}
    two = f"K-FAC rank {r} + tails, two anchors summed ({args.iterations:g} iterations)"
    plans = {
        "fsdp2": fsdp2,
        "ddp": ddp,
        "fsdp1": partial(flat, master=False),
        "zero3": partial(flat, master=True),
    }
    for plan, fn in plans.items():
        rows_of = (lambda w: w.out_dim / n) if plan == "fsdp2" else (lambda w: w.out_dim)
        for label, weights, key in (
            (f"K-FAC rank {r} + tails", ranked, ""),
            ("K-FAC kfac_rank=None", full, "full_"),
            (two, ranked, "two_anchor_"),
        ):
            if key == "two_anchor_" and plan in ("fsdp1", "zero3"):
                continue  # refused on flat pieces
            cost = fn(model, weights, n)
            if key == "two_anchor_":
                cost = summed(cost, weights, rows_of, 2, args.iterations, n, plan == "fsdp2")
            row = kfac_row(label, plan, cost, model, step_s, args)
            results.update({f"{key}{plan}_{figure}": value for figure, value in row.items()})
    print(
        f"RESULT model={name} gpus={n} kfac_rank={r} linear_weights_diagonal={len(model.linear_diagonal)} "
        f"factored_share={factored / model.params:.4f} " + " ".join(f"{k}={v:.3g}" for k, v in results.items())
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=8, help="GPUs (processes)")
    parser.add_argument("--kfac-rank", type=int, default=256, help="R: eigenpairs kept per factor, with tails")
    parser.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tokens-per-gpu", type=int, default=16384, help="tokens per optimizer step per GPU")
    parser.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilization of the training step")
    parser.add_argument("--bf16-tflops", type=float, default=989.0, help="dense bf16 peak (H100 SXM)")
    parser.add_argument("--fp64-tflops", type=float, default=67.0, help="dense float64 peak (H100 SXM tensor cores)")
    parser.add_argument("--hbm-tbps", type=float, default=3.35, help="HBM bandwidth, TB/s (H100 SXM)")
    parser.add_argument("--hbm-gb", type=float, default=80.0, help="HBM per GPU, GB (H100 SXM)")
    parser.add_argument("--link-gbps", type=float, default=360.0, help="collective bus bandwidth, GB/s (NVLink)")
    parser.add_argument("--efficiency", type=float, default=0.7, help="share of peak the correction reaches")
    parser.add_argument(
        "--iterations",
        type=float,
        default=ITERATIONS,
        help="conjugate-gradient iterations per weight of two summed anchors (default: measured by bench_kfac.py)",
    )
    args = parser.parse_args(argv)
    print(
        f"Assumed per GPU: dense bf16 {args.bf16_tflops:g} TFLOP/s, float64 {args.fp64_tflops:g}, "
        f"HBM {args.hbm_tbps:g} TB/s, {args.hbm_gb:g} GB, "
        f"both at {args.efficiency:.0%}; collectives at {args.link_gbps:g} GB/s; training at {args.mfu:.0%} MFU. "
        "Correction time = FLOPs + HBM traffic + communication, no overlap (computed, not measured)."
    )
    for name in args.models:
        report(name, args)


if __name__ == "__main__":
    main()
