"""How far a bfloat16 estimate of F (and of K-FAC factors) lies from a float32 one, side by side in one run.

The model: the embedded SmolLM2-135M-Instruct (`load_causal_lm("smollm2-135m")`, float32) and a copy with its
parameters cast to bfloat16 and its buffers (rotary frequencies) left in float32: what `load_causal_lm(...,
dtype="bfloat16")`, and so `hf-cfp estimate --dtype bfloat16`, loads (`tests/integration/test_cli_hub_model.py`
checks that equality). Prompts: the first N of the bundled `math` set. Responses: drawn by `model.generate` at
temperature 1 without truncation (`top_k=0`), one per prompt, cut after the first EOS; they are scored with
`estimate_fisher(..., estimator="empirical", responses=...)`, which on the model's own samples at temperature 1 is
the sequence estimator, F_i = (1/N) sum_n (d/dtheta_i log pi(y_n | x_n))^2.

Each structure (diagonal, then kfac at full rank) is estimated from the float32 model on the float32 model's own
responses (seed 0): the reference, F_32. Against it, three estimates:

  bf16, same sequences    the bfloat16 model scoring the reference's responses: the arithmetic alone
  bf16, own samples       the bfloat16 model's own responses (seed 0) scored by it: what --dtype bfloat16 changes
  fp32, seed 1 (noise)    the float32 model on other responses (seed 1): the sampling noise at this N, the scale
                          against which the second row is read

Columns: the relative error of the total mass, |M - M_32| / M_32 with M = sum_i F_i (for K-FAC the implied diagonal's
mass, `statistics()["total_mass"]`); the top-1% overlap |T1(F) ∩ T1(F_32)| / |T1| and the cosine of F with F_32
(`anchor.compare.compare_anchors`, on the implied diagonal for K-FAC); for K-FAC, the relative Frobenius error of the
factors pooled over the Linear weights, sqrt(sum_w ||X_w - X_32,w||_F^2 / sum_w ||X_32,w||_F^2) for X = A and X = G.
The last line is machine-readable (the first row's numbers, then the second's and the third's top-1% overlaps):

  RESULT mass_rel_err=<a> top1_overlap=<b> kfac_mass_rel_err=<c> kfac_top1_overlap=<d> kfac_a_rel_frob=<e>
         kfac_g_rel_frob=<f> own_samples_top1_overlap=<g> noise_top1_overlap=<h> (and the kfac ones of the last two)

bfloat16 matmuls round differently on CPUs with AVX-512 bf16 / AMX than on AVX2 ones (and on a GPU): the figures are
those of the machine that ran them, whose CPU flags the script prints.

    python scripts/compare_dtype.py [--sequences 16] [--new-tokens 32] [--threads 1] [--model smollm2-135m]
"""

import argparse
import copy
import math
import time

import torch

from hf_cfp import estimate_fisher
from hf_cfp.anchor.compare import compare_anchors
from hf_cfp.fisher.token_ids import to_token_ids
from hf_cfp.geometry import STRUCTURES
from hf_cfp.loading.models import EMBEDDED, load_causal_lm
from hf_cfp.loading.prompts import load_prompts

ROWS = ("bf16, same sequences", "bf16, own samples", "fp32, seed 1 (noise)")
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")  # the bf16 kernels torch may pick on an x86 CPU


def draw(model, prompts: list[list[int]], new_tokens: int, eos: int, seed: int) -> list[list[int]]:
    """One response per prompt from `model` at temperature 1, no truncation, seeded; each cut after its first EOS."""
    torch.manual_seed(seed)
    responses = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new_tokens,
            pad_token_id=eos,
            eos_token_id=eos,
        )[0, len(prompt) :].tolist()
        responses.append(out[: out.index(eos) + 1] if eos in out else out)
    return responses


def score(model, tokenizer, prompts, responses, structure: str):
    """F (or K-FAC) of `model` on the given sequences: the sequence estimator at temperature 1 on them."""
    return estimate_fisher(
        model,
        tokenizer,
        prompts,
        num_sequences=len(prompts),
        estimator="empirical",
        responses=responses,
        structure=structure,
        show_progress=False,
    )


def factor_errors(reference, other) -> dict[str, float]:
    """Relative Frobenius errors of the K-FAC factors pooled over the weights: {"A": ..., "G": ...}."""
    sums = {"A": [0.0, 0.0], "G": [0.0, 0.0]}  # ||X - X_32||^2, ||X_32||^2
    for name in reference.kfac_names:
        for which, x32, x in zip("AG", reference.kfac_factors(name), other.kfac_factors(name), strict=True):
            x32, x = x32.double(), x.double()
            sums[which][0] += float((x - x32).pow(2).sum())
            sums[which][1] += float(x32.pow(2).sum())
    return {which: math.sqrt(error / norm) for which, (error, norm) in sums.items()}


def measure(reference, other) -> dict[str, float]:
    """The row of `other` against `reference`: mass error, top-1% overlap, cosine, and the factors' errors."""
    mass32, mass = reference.statistics()["total_mass"], other.statistics()["total_mass"]
    compared = compare_anchors(reference, other)
    row = {"mass_rel_err": abs(mass - mass32) / mass32, "top1": compared["top_overlap"]["1%"]}
    row["cosine"] = compared["cosine"]
    if reference.kfac:
        row.update({f"{which.lower()}_rel_frob": error for which, error in factor_errors(reference, other).items()})
    return row


def rows_for(structure: str, models: dict, tokenizer, prompts, sequences: dict) -> dict[str, dict[str, float]]:
    """The three rows of `ROWS` for one structure, each estimate freed before the next (memory)."""
    start = time.perf_counter()
    reference = score(models["fp32"], tokenizer, prompts, sequences["fp32"], structure)
    cases = dict(zip(ROWS, (("bf16", "fp32"), ("bf16", "bf16"), ("fp32", "fp32 seed 1")), strict=True))
    rows = {
        label: measure(reference, score(models[which], tokenizer, prompts, sequences[drawn], structure))
        for label, (which, drawn) in cases.items()
    }
    print(f"{structure}: 4 estimates in {time.perf_counter() - start:.0f} s", flush=True)
    return rows


def print_table(results: dict[str, dict[str, dict[str, float]]]) -> None:
    """One line per (structure, row); K-FAC rows add the factors' errors."""
    print(
        f"\n{'structure':>9} | {'against float32 seed 0':>22} | {'mass rel err':>12} | {'top-1% overlap':>14} | "
        f"{'cosine':>8} | {'A rel Frob':>10} | {'G rel Frob':>10}"
    )
    for structure, rows in results.items():
        for label, row in rows.items():
            factors = "".join(f" | {row[key]:>10.2e}" for key in ("a_rel_frob", "g_rel_frob") if key in row)
            print(
                f"{structure:>9} | {label:>22} | {row['mass_rel_err']:>12.2e} | {row['top1']:>14.4f} | "
                f"{row['cosine']:>8.6f}{factors}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=EMBEDDED, help="what load_causal_lm takes (default: the embedded model)")
    parser.add_argument("--sequences", type=int, default=16, help="calibration sequences (prompts of the math set)")
    parser.add_argument("--new-tokens", type=int, default=32, help="longest response")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 on a shared machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_causal_lm(args.model)
    bf16 = copy.deepcopy(model)
    for parameter in bf16.parameters():  # buffers stay float32, as from_pretrained(dtype=bfloat16) keeps them
        parameter.data = parameter.data.to(torch.bfloat16)
    models = {"fp32": model.eval(), "bf16": bf16.eval()}
    prompts = to_token_ids(load_prompts("math")[: args.sequences], tokenizer)
    eos = tokenizer.eos_token_id
    start = time.perf_counter()
    with torch.no_grad():
        sequences = {
            "fp32": draw(model, prompts, args.new_tokens, eos, seed=0),
            "bf16": draw(bf16, prompts, args.new_tokens, eos, seed=0),
            "fp32 seed 1": draw(model, prompts, args.new_tokens, eos, seed=1),
        }
    tokens = {key: sum(map(len, value)) for key, value in sequences.items()}
    print(f"sampled {tokens} response tokens in {time.perf_counter() - start:.0f} s", flush=True)
    results = {structure: rows_for(structure, models, tokenizer, prompts, sequences) for structure in STRUCTURES}
    flags = sorted({flag for flag in open("/proc/cpuinfo").read().split() if flag in CPU_FLAGS})
    size = f"N = {args.sequences} sequences of at most {args.new_tokens} new tokens"
    print(
        f"\n{args.model}: {size}; torch {torch.__version__}, {args.threads} thread(s); "
        f"CPU flags: {' '.join(flags) or 'none of ' + ' '.join(CPU_FLAGS)}"
    )
    print_table(results)
    diagonal, kfac = results["diagonal"], results["kfac"]
    same, own, noise = ROWS
    result = {
        "mass_rel_err": diagonal[same]["mass_rel_err"],
        "top1_overlap": diagonal[same]["top1"],
        "kfac_mass_rel_err": kfac[same]["mass_rel_err"],
        "kfac_top1_overlap": kfac[same]["top1"],
        "kfac_a_rel_frob": kfac[same]["a_rel_frob"],
        "kfac_g_rel_frob": kfac[same]["g_rel_frob"],
        "own_samples_top1_overlap": diagonal[own]["top1"],
        "noise_top1_overlap": diagonal[noise]["top1"],
        "kfac_own_samples_top1_overlap": kfac[own]["top1"],
        "kfac_noise_top1_overlap": kfac[noise]["top1"],
    }
    print("RESULT " + " ".join(f"{key}={value:.3g}" for key, value in result.items()))


if __name__ == "__main__":
    main()
