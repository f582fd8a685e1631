"""CFPCallback inside TRL's SFTTrainer and RLOOTrainer, full-parameter (their PEFT runs: test_trl_peft.py).

CPU, tiny Llamas built in memory (RLOO's reference model, beta > 0, is loaded from a local save of the same
model), a few steps each. Two independent checks per run (tests/support/references.py):

- `StepReference`: after every optimizer step, the weights equal the float64 formula
  theta0 + (proposal - theta0) / (1 + lam F) applied to the proposal the optimizer actually made, within
  float32 rounding;
- `drift_reference`: the cfp metrics of the last logging step (the last step) equal the float64 drift of the
  final weights from theta0 (rel 1e-5: the logged sums are float32, see test_trainers.py's METRIC_REL).

Both must also show the correction mattered: the logged sensitive drift is below a tenth of the run without
the callback's pull (lam = 0, the same trainer and data).
"""

from support.anchors import random_anchor
from support.extras import requires
from support.references import StepReference, assert_metrics_match, drift_reference
from support.tiny import tiny_llama, tiny_tokenizer
from transformers import LlamaForCausalLM

from hf_cfp import CFPCallback

pytestmark = requires("trl", "datasets")  # TRL's SFTTrainer and RLOOTrainer

LAM, STEPS = 10.0, 3
SENS = "cfp/math/sensitive_drift"


def common_args(output_dir):
    """TRL's defaults made CPU-friendly (no bf16, no activation checkpointing), a log every step."""
    return dict(
        output_dir=str(output_dir),
        use_cpu=True,
        bf16=False,
        activation_checkpointing=False,
        logging_steps=1,
        max_steps=STEPS,
        report_to="none",
        learning_rate=1e-2,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )


def base_model(tokenizer):
    model = tiny_llama(vocab_size=len(tokenizer), hidden_size=16, seed=0, eos_token_id=tokenizer.eos_token_id)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def check_run(trainer, theta0, anchor, check):
    """StepReference held at every step, and the last step's metrics equal the float64 drift. Returns them."""
    assert check.steps == STEPS and check.violations == 0, (
        check.steps,
        check.violations,
        check.largest_gap_over_bound,
    )
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["step"] for h in logs] == list(range(1, STEPS + 1))
    last = {k: v for k, v in logs[-1].items() if k.startswith("cfp/")}
    final = {n: p.detach() for n, p in trainer.model.named_parameters()}
    reference = drift_reference({n: final[n].double() - theta0[n] for n in final}, anchor.fisher, "math")
    assert_metrics_match(last, reference, rel=1e-5)
    assert last["cfp/math/lam"] == check.lam
    return last


# ---------------------------------------------------------------- SFT


def run_sft(tmp_path, lam):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    tokenizer = tiny_tokenizer()
    model = base_model(tokenizer)
    theta0 = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    anchor = random_anchor(model)
    check = StepReference(anchor.fisher, lam)
    words = ["two", "plus", "three", "is", "five", "what", "the", "answer", "code", "print", "sum"]
    texts = [" ".join(words[(i * k + 3) % len(words)] for k in range(1, 7)) for i in range(12)]
    args = SFTConfig(**common_args(tmp_path / f"sft{lam}"), per_device_train_batch_size=4, max_length=16)
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_dict({"text": texts}),
        processing_class=tokenizer,
        callbacks=[CFPCallback(anchor, lam=lam), check],
    )
    trainer.train()
    return check_run(trainer, theta0, anchor, check)


def test_sft_trainer_follows_the_reference_and_logs_the_float64_drift(tmp_path):
    protected, plain = run_sft(tmp_path, LAM), run_sft(tmp_path, 0.0)
    print(f"SFT: sensitive drift {protected[SENS]:.4g} with lam {LAM}, {plain[SENS]:.4g} with lam 0")
    assert 0 < protected[SENS] < 0.1 * plain[SENS]


# ---------------------------------------------------------------- RLOO


def _reward_letters(completions, **kwargs):
    """Reward the number of 'e' characters plus a small length term."""
    return [float(c.count("e")) + 0.1 * len(c) for c in completions]


def run_rloo(tmp_path, lam):
    from datasets import Dataset
    from trl import RLOOConfig, RLOOTrainer

    tokenizer = tiny_tokenizer()
    local = tmp_path / "base"  # beta > 0: RLOO loads its reference model by name, so the model comes from disk
    if not local.exists():
        base_model(tokenizer).save_pretrained(local)
    model = LlamaForCausalLM.from_pretrained(local)
    theta0 = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    anchor = random_anchor(model)
    check = StepReference(anchor.fisher, lam)
    prompts = ["what is two plus three", "print the sum", "the answer is", "code the sum"] * 2
    args = RLOOConfig(
        **common_args(tmp_path / f"rloo{lam}"),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=8,
        beta=0.05,
    )
    trainer = RLOOTrainer(
        model=model,
        reward_funcs=_reward_letters,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
        callbacks=[CFPCallback(anchor, lam=lam), check],
    )
    trainer.train()
    assert "reward" in [h for h in trainer.state.log_history if "loss" in h][-1]  # TRL's metrics, same log
    return check_run(trainer, theta0, anchor, check)


def test_rloo_trainer_follows_the_reference_and_logs_the_float64_drift(tmp_path):
    protected, plain = run_rloo(tmp_path, LAM), run_rloo(tmp_path, 0.0)
    print(f"RLOO: sensitive drift {protected[SENS]:.4g} with lam {LAM}, {plain[SENS]:.4g} with lam 0")
    assert 0 < protected[SENS] < 0.1 * plain[SENS]
