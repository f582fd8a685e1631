"""Resuming from a checkpoint keeps the original theta0: bit-identical to an uninterrupted run."""

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from support.anchors import random_anchor
from support.extras import needs
from support.tiny import tiny_llama
from support.training import CrashAfterSave, checkpointed_run

import hf_cfp.integrations.callback as callback_module
from hf_cfp import CFPCallback, CFPError


def run(output_dir, extra=(), resume=None, args_overrides=None, lora_targets=None, **callback_kwargs):
    """6 steps of a tiny Llama (checkpoints every 2), protected by a "math" anchor with a "code" monitor, lam =
    2 * step. With `lora_targets`: a PeftModel (LoRA r=4 there, lm_head trained through modules_to_save) and
    anchors keyed by the base model's names, so the protecting one corrects the LoRA factors."""
    model = tiny_llama()
    anchors = dict(anchor=random_anchor(model, "math", seed=1), monitor=[random_anchor(model, "code", seed=2)])
    if lora_targets is not None:
        needs("peft")
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=lora_targets, modules_to_save=["lm_head"]))
    cfp = CFPCallback(lam=lambda step: 2.0 * step, **anchors, **callback_kwargs)
    return checkpointed_run(model, output_dir, [cfp, *extra], resume, save_total_limit=1, **(args_overrides or {}))


def max_gap(a, b):
    return max((a[n] - b[n]).abs().max().item() for n in a)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uninterrupted run, and a run that crashed after saving checkpoint-4 (checkpoint-2 rotated away)."""
    tmp = tmp_path_factory.mktemp("resume")
    straight, straight_logs = run(tmp / "straight")
    with pytest.raises(KeyboardInterrupt):
        run(tmp / "crashed", extra=[CrashAfterSave(4)])
    shutil.copytree(tmp / "crashed", tmp / "kept")  # resuming in "crashed" rotates checkpoint-4 away
    return tmp, straight, straight_logs


def test_checkpoint_holds_theta0_and_resume_true_is_bit_identical(runs):
    tmp, straight, straight_logs = runs
    checkpoints = sorted(p.name for p in (tmp / "crashed").glob("checkpoint-*"))
    assert checkpoints == ["checkpoint-4"]  # save_total_limit=1 rotated checkpoint-2 away
    saved = sorted(p.name for p in (tmp / "crashed" / "checkpoint-4").glob("cfp_theta0*"))
    assert saved == ["cfp_theta0-rank00000-of-00001.safetensors"]
    resumed, resumed_logs = run(tmp / "crashed", resume=True)
    assert all(torch.equal(resumed[n], straight[n]) for n in straight)
    last = {k: v for k, v in straight_logs[-2].items() if k.startswith("cfp/")}
    # per anchor sensitive, free and predicted KL, the total, and the protecting anchor's lam
    assert len(last) == 8 and last == {k: resumed_logs[-2][k] for k in last}


def test_a_checkpoint_moved_elsewhere_resumes_into_a_fresh_output_dir(runs):
    """The theta0 comes from the checkpoint being resumed, not from output_dir/checkpoint-<step>."""
    tmp, straight, _ = runs
    moved = tmp / "another-machine" / "my-checkpoint"
    shutil.copytree(tmp / "kept" / "checkpoint-4", moved)
    resumed, _ = run(tmp / "fresh-output", resume=str(moved))
    assert all(torch.equal(resumed[n], straight[n]) for n in straight)


def test_args_resume_from_checkpoint_is_used_when_the_trainer_call_is_unknown(runs, monkeypatch):
    """A trainer whose resume path the callback cannot read (simulated): TrainingArguments(
    resume_from_checkpoint=...) names the checkpoint."""
    tmp, straight, _ = runs
    moved = tmp / "explicit" / "ckpt"
    shutil.copytree(tmp / "kept" / "checkpoint-4", moved)
    monkeypatch.setattr(callback_module, "find_trainer_call", lambda callback: None)
    overrides = {"resume_from_checkpoint": str(moved)}
    resumed, _ = run(tmp / "explicit-output", resume=str(moved), args_overrides=overrides)
    assert all(torch.equal(resumed[n], straight[n]) for n in straight)


def test_a_checkpoint_without_theta0_is_an_error_unless_restarting_is_asked_for(runs):
    tmp, straight, _ = runs
    bare = tmp / "bare" / "checkpoint-4"  # the same checkpoint, as saved without CFPCallback
    shutil.copytree(tmp / "kept" / "checkpoint-4", bare)
    for saved in bare.glob("cfp_theta0*"):
        saved.unlink()
    with pytest.raises(CFPError, match="restart_path_on_resume=True"):
        run(tmp / "bare-out", resume=str(bare))
    # Opting in restarts the path at the checkpoint's weights: another run.
    restarted, _ = run(tmp / "bare-out2", resume=str(bare), restart_path_on_resume=True)
    assert max_gap(restarted, straight) > 1e-4


# PEFT LoRA: theta0 = the LoRA factors at train begin (s0, B0, A0) plus the trained base parameters.
LORA_TARGETS = ["q_proj", "v_proj"]


def lora_run(output_dir, extra=(), resume=None, target_modules=LORA_TARGETS, **callback_kwargs):
    """`run` on a PeftModel."""
    return run(output_dir, extra, resume, lora_targets=target_modules, **callback_kwargs)


def cfp_logs(history):
    return [{k: v for k, v in h.items() if k.startswith("cfp/")} for h in history if "loss" in h]


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
    """The uninterrupted LoRA run, and one that crashed after saving checkpoint-4 (kept as a copy)."""
    tmp = tmp_path_factory.mktemp("resume-lora")
    straight, straight_logs = lora_run(tmp / "straight")
    with pytest.raises(KeyboardInterrupt):
        lora_run(tmp / "crashed", extra=[CrashAfterSave(4)])
    return tmp, straight, straight_logs


def test_a_lora_run_resumes_bit_identically_from_its_train_begin_factors(lora_runs):
    tmp, straight, straight_logs = lora_runs
    checkpoint = tmp / "crashed" / "checkpoint-4"
    # The lm_head copy's theta0 and the q/v factors at train begin: B0 = 0 (PEFT's init), A0 = the initial A.
    with safe_open(str(checkpoint / "cfp_theta0-rank00000-of-00001.safetensors"), framework="pt") as saved:
        scales = json.loads(saved.metadata()["cfp_lora0"])
        assert sorted(scales) == sorted(ADAPTED) and all(s == [["default", 2.0]] for s in scales.values())
        assert sorted(saved.keys()) == sorted(
            ["lm_head.weight", *(f"cfp_lora0/{n}/default/{f}" for n in ADAPTED for f in "BA")]
        )
        first = saved.get_tensor(f"cfp_lora0/{ADAPTED[0]}/default/A")
        assert torch.equal(saved.get_tensor(f"cfp_lora0/{ADAPTED[0]}/default/B"), torch.zeros(16, 4))
    initial_a = lora_a_at_init()
    assert torch.equal(first, initial_a) and not torch.equal(first, straight[LORA_A])  # A moved since
    shutil.copytree(checkpoint, tmp / "moved" / "checkpoint-4")
    resumed, resumed_logs = lora_run(tmp / "fresh", resume=str(tmp / "moved" / "checkpoint-4"))
    assert resumed.keys() == straight.keys()
    assert all(torch.equal(resumed[n], straight[n]) for n in straight)
    expected = cfp_logs(straight_logs)[4:]  # steps 5 and 6
    assert len(expected) == 2 and len(expected[-1]) == 9  # 7 drift metrics, the lam and the adapter residual
    assert cfp_logs(resumed_logs)[-2:] == expected
    assert expected[-1]["cfp/total_drift"] > 0.1 and expected[-1]["cfp/math/adapter_residual"] > 0


ADAPTED = [f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(2) for p in "qv"]
LORA_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"


def lora_a_at_init():
    """The first q_proj's LoRA A as get_peft_model initializes it (the seed of `lora_run`'s model)."""
    from peft import LoraConfig, get_peft_model  # the `peft` extra: called after `lora_runs` checked it

    model = get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=LORA_TARGETS, modules_to_save=["lm_head"]))
    return dict(model.named_parameters())[LORA_A].detach()
