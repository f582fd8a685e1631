"""CFPCallback with TRL's SFTTrainer, DPOTrainer and GRPOTrainer given `peft_config=`: TRL builds the PeftModel.

Each trainer gets a plain tiny Llama, `peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"])` and
`callbacks=[CFPCallback(anchor)]` with an anchor keyed by the base model's names (and its fingerprint, checked
through the PeftModel). The logged base-space drift at the final step is checked against a float64 reference
written here: `merge_and_unload()` of a deep copy of the trained model against the base weights. Each protected
run is compared with the same run at lam = 0. For DPO, whose reference model is the base model with the adapters
disabled (`ref_model=None`), the reference log-probs TRL used at every step are checked against the untouched
base model, and the frozen base weights bitwise.
"""

import contextlib
import copy
import math

import pytest
import torch
from support.extras import needs

needs("trl", "datasets", "peft")

from peft import LoraConfig  # noqa: E402
from support.references import drift_reference  # noqa: E402
from support.tiny import anchor_for, tiny_llama, tiny_tokenizer  # noqa: E402

from hf_cfp import CFPCallback  # noqa: E402
from hf_cfp.anchor.fingerprint import model_fingerprint  # noqa: E402
from hf_cfp.errors import AnchorMismatchError  # noqa: E402

ADAPTED = [f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(2) for p in "qv"]
SENS, FREE, TOTAL = "cfp/math/sensitive_drift", "cfp/math/free_drift", "cfp/total_drift"
RESIDUAL = "cfp/math/adapter_residual"
LAM = 100.0  # F ~ U(0, 1): lam F is ~50 on most coordinates
STEPS = 3


def lora_config():
    """A fresh config per run: TRL may edit the one it is given."""
    return LoraConfig(r=4, target_modules=["q_proj", "v_proj"])


def base_and_anchor(tokenizer, eos=False):
    """(tiny Llama, its float64 weights by name, an anchor over every parameter with the base fingerprint)."""
    kwargs = {"eos_token_id": tokenizer.eos_token_id} if eos else {}
    base = tiny_llama(vocab_size=len(tokenizer), hidden_size=16, seed=0, **kwargs)
    if eos:
        base.config.pad_token_id = tokenizer.pad_token_id
        base.generation_config.eos_token_id = tokenizer.eos_token_id
        base.generation_config.pad_token_id = tokenizer.pad_token_id
    weights = {n: p.detach().double().clone() for n, p in base.named_parameters()}
    anchor = anchor_for(base, seed=1)
    anchor.metadata["base_fingerprint"] = model_fingerprint(base)
    return base, weights, anchor


def common_args(tmp_path, tag):
    return {
        "output_dir": str(tmp_path / tag),
        "use_cpu": True,
        "bf16": False,
        "activation_checkpointing": False,
        "logging_steps": 1,
        "max_steps": STEPS,
        "report_to": "none",
        "learning_rate": 1e-2,
        "save_strategy": "no",
        "disable_tqdm": True,
        "seed": 0,
    }


def merged_reference(peft_model, weights, anchor, free_fraction=0.99):
    """float64 drift of merge_and_unload() (of a deep copy cast to float64) against the base weights. Only the
    LoRA-adapted weights may differ from the base: every other merged weight must equal it bitwise.

    The merge runs in float64: the protected runs drift by ~1e-3 while the weights are ~3e-2, so a float32 merge
    (W + s B A rounded to float32, then W subtracted) is itself off by 2e-7..1.1e-6 of the drift (seen here),
    against 4e-9..6e-8 between the logged metrics and this float64 merge.
    """
    merged = dict(copy.deepcopy(peft_model).double().merge_and_unload().named_parameters())
    assert merged.keys() == weights.keys()
    for name in weights.keys() - set(ADAPTED):
        assert torch.equal(merged[name], weights[name]), f"{name} moved"
    deltas = {n: merged[n].detach() - weights[n] for n in ADAPTED}
    return drift_reference(deltas, anchor.fisher, anchor.name, free_fraction)


def check_run(trainer, weights, anchor, lam):
    """The run finished with TRL's PeftModel; cfp/* in every loss log; the last one (at the final step) equals
    the merged float64 reference. Returns the reference."""
    from peft import PeftModel

    model = trainer.model
    assert isinstance(model, PeftModel)
    assert trainer.state.global_step == STEPS
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["step"] for h in logs] == list(range(1, STEPS + 1))
    keys = [SENS, FREE, TOTAL] + ([RESIDUAL] if lam > 0 else [])
    for h in logs:
        for key in keys:
            assert key in h and math.isfinite(h[key]) and h[key] >= 0, (h["step"], key, h)
        assert (RESIDUAL in h) == (lam > 0)  # only a correction has a residual
    reference = merged_reference(model, weights, anchor)
    last = logs[-1]
    for key, value in reference.items():
        assert value > 0, key
        print(f"lam={lam:g} {key}: logged {last[key]:.6e}, float64 {value:.6e}, relative {last[key] / value - 1:+.1e}")
        assert last[key] == pytest.approx(value, rel=1e-6), (key, last[key], value)
    return reference


def assert_protected(protected, plain):
    """lam > 0 keeps the sensitive drift far below the unprotected run's."""
    print(f"sensitive drift: lam={LAM:g} {protected[SENS]:.3e}, lam=0 {plain[SENS]:.3e}")
    assert protected[SENS] * 5 <= plain[SENS], (protected[SENS], plain[SENS])


# ---------------------------------------------------------------- SFT


def _run_sft(tmp_path, tokenizer, lam, tag, anchor_fingerprint_of=None):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    base, weights, anchor = base_and_anchor(tokenizer)
    if anchor_fingerprint_of is not None:
        anchor.metadata["base_fingerprint"] = model_fingerprint(anchor_fingerprint_of)
    words = ["two", "plus", "three", "is", "five", "what", "the", "answer", "code", "print", "sum"]
    texts = [" ".join(words[(i * k + 3) % len(words)] for k in range(1, 7)) for i in range(12)]
    args = SFTConfig(**common_args(tmp_path, tag), per_device_train_batch_size=4, max_length=16, packing=False)
    trainer = SFTTrainer(
        model=base,
        args=args,
        train_dataset=Dataset.from_dict({"text": texts}),
        processing_class=tokenizer,
        peft_config=lora_config(),
        callbacks=[CFPCallback(anchor, lam=lam)],
    )
    trainer.train()
    return check_run(trainer, weights, anchor, lam)


def test_sft_with_peft_config_metrics_match_merged_reference_and_protect(tmp_path):
    tokenizer = tiny_tokenizer()
    protected = _run_sft(tmp_path, tokenizer, LAM, "sft")
    plain = _run_sft(tmp_path, tokenizer, 0.0, "sft-plain")
    assert_protected(protected, plain)


def test_sft_with_peft_config_refuses_an_anchor_of_another_base(tmp_path):
    """The fingerprint check runs through TRL's PeftModel: it passes above, and bites here."""
    tokenizer = tiny_tokenizer()
    other = tiny_llama(vocab_size=len(tokenizer), hidden_size=16, seed=1)
    with pytest.raises(AnchorMismatchError, match="math"):
        _run_sft(tmp_path, tokenizer, LAM, "sft-other", anchor_fingerprint_of=other)


# ---------------------------------------------------------------- DPO


def _preference_dataset():
    from datasets import Dataset

    return Dataset.from_dict(
        {
            "prompt": ["what is two plus three", "print the sum", "what is the answer", "two plus two is"] * 2,
            "chosen": [" five", " print sum", " five", " four", " sum code", " five is five", " two", " five"],
            "rejected": [" three", " the code", " two plus", " three plus", " what", " two", " three", " what is"],
        }
    )


def _completion_logps(model, inputs):
    """float64 sum of log p(token) over the completion tokens of a DPO batch (an independent reference)."""
    with torch.no_grad():
        logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits.double()
    logps = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, inputs["input_ids"][:, 1:, None])[..., 0]
    return (logps * inputs["completion_mask"][:, 1:]).sum(dim=1)


def _run_dpo(tmp_path, tokenizer, lam, tag, record=False):
    """3 DPO steps with ref_model=None; with `record`, every batch and every reference context are recorded."""
    import trl.trainer.dpo_trainer as dpo_module
    from trl import DPOConfig, DPOTrainer

    base, weights, anchor = base_and_anchor(tokenizer)
    untouched = copy.deepcopy(base)  # before TRL wraps `base` in place
    args = DPOConfig(**common_args(tmp_path, tag), per_device_train_batch_size=2, max_length=32)
    trainer = DPOTrainer(
        model=base,
        ref_model=None,
        args=args,
        train_dataset=_preference_dataset(),
        processing_class=tokenizer,
        peft_config=lora_config(),
        callbacks=[CFPCallback(anchor, lam=lam)],
    )
    batches, contexts = [], []
    with pytest.MonkeyPatch.context() as monkeypatch:
        if record:
            real_use_adapter = dpo_module.use_adapter

            @contextlib.contextmanager
            def spy_use_adapter(model, adapter_name):
                with real_use_adapter(model, adapter_name):
                    lora_layers = [m for n, m in model.named_modules() if n.endswith(("q_proj", "v_proj"))]
                    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if "base_layer" in n}
                    contexts.append((adapter_name, all(m.disable_adapters for m in lora_layers), frozen))
                    yield

            def recording_compute_loss(model, inputs, *args, **kwargs):
                batches.append({k: v.detach().clone() for k, v in inputs.items()})
                return type(trainer).compute_loss(trainer, model, inputs, *args, **kwargs)

            monkeypatch.setattr(dpo_module, "use_adapter", spy_use_adapter)
            monkeypatch.setattr(trainer, "compute_loss", recording_compute_loss)
        trainer.train()
    return trainer, check_run(trainer, weights, anchor, lam), untouched, batches, contexts


def test_dpo_with_peft_config_reference_is_the_untouched_base(tmp_path):
    tokenizer = tiny_tokenizer()
    trainer, protected, untouched, batches, contexts = _run_dpo(tmp_path, tokenizer, LAM, "dpo", record=True)
    _, plain, _, _, _ = _run_dpo(tmp_path, tokenizer, 0.0, "dpo-plain")
    assert_protected(protected, plain)

    model = trainer.model
    assert "ref" not in model.peft_config  # a new adapter: the reference is the base with adapters disabled
    base_params = dict(untouched.named_parameters())

    def base_name(peft_name):  # base_model.model.<name> with .base_layer removed
        return peft_name.removeprefix("base_model.model.").replace(".base_layer", "")

    # 1. the frozen base weights behind the LoRA layers are bitwise the base model's, after training ...
    frozen = {n: p for n, p in model.named_parameters() if "base_layer" in n}
    assert len(frozen) == len(ADAPTED)
    for name, p in frozen.items():
        assert not p.requires_grad
        assert torch.equal(p, base_params[base_name(name)]), name
    # ... and at every reference forward TRL made during training (one per step), with adapters disabled
    assert len(contexts) == STEPS
    for adapter_name, disabled, weights_then in contexts:
        assert adapter_name is None and disabled
        for name, w in weights_then.items():
            assert torch.equal(w, base_params[base_name(name)]), name

    # 2. the reference log-probs TRL used at each step are the untouched base model's on that step's batch:
    #    logged rewards/chosen = beta * mean(logps - ref_logps), so mean(ref_logps) = logps/chosen - rewards/beta
    assert len(batches) == STEPS
    logs = [h for h in trainer.state.log_history if "loss" in h]
    beta = trainer.args.beta
    for log, batch in zip(logs, batches, strict=True):
        chosen_ref, rejected_ref = _completion_logps(untouched, batch).chunk(2)
        for side, ref in (("chosen", chosen_ref), ("rejected", rejected_ref)):
            used = log[f"logps/{side}"] - log[f"rewards/{side}"] / beta
            assert used == pytest.approx(float(ref.mean()), rel=1e-5), (log["step"], side, used, float(ref.mean()))

    # 3. after training: with the adapters disabled the model computes bitwise the base model's logits; with
    #    them enabled it does not (the protected adapters moved little, but they moved)
    model.eval()
    for batch in batches:
        kwargs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        with torch.no_grad():
            base_logits = untouched(**kwargs).logits
            with model.disable_adapter():
                disabled_logits = model(**kwargs).logits
            adapted_logits = model(**kwargs).logits
        assert torch.equal(disabled_logits, base_logits)
        assert not torch.equal(adapted_logits, base_logits)


# ---------------------------------------------------------------- GRPO


def _reward_letters(completions, **kwargs):
    """Reward the number of 'e' characters plus a small length term."""
    return [float(c.count("e")) + 0.1 * len(c) for c in completions]


def _run_grpo(tmp_path, tokenizer, lam, tag):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    base, weights, anchor = base_and_anchor(tokenizer, eos=True)
    prompts = ["what is two plus three", "print the sum", "the answer is", "code the sum"] * 2
    args = GRPOConfig(
        **common_args(tmp_path, tag), per_device_train_batch_size=4, num_generations=2, max_completion_length=8
    )
    trainer = GRPOTrainer(
        model=base,
        reward_funcs=_reward_letters,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
        peft_config=lora_config(),
        callbacks=[CFPCallback(anchor, lam=lam)],
    )
    trainer.train()
    assert "reward" in [h for h in trainer.state.log_history if "loss" in h][-1]  # TRL's metrics, same log
    return check_run(trainer, weights, anchor, lam)


def test_grpo_with_peft_config_metrics_match_merged_reference_and_protect(tmp_path):
    tokenizer = tiny_tokenizer()
    protected = _run_grpo(tmp_path, tokenizer, LAM, "grpo")
    plain = _run_grpo(tmp_path, tokenizer, 0.0, "grpo-plain")
    assert_protected(protected, plain)
