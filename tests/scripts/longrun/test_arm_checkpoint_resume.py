"""An arm of the long run cut off mid-run (an exception after its second checkpoint, as a killed process leaves
it) and started again resumes from its last checkpoint and ends where the same arm run whole ends: the same
weights, the same curve at every measured step (the points before the cut read back, not measured twice), the
same logged history. Checked on CFP-KFAC under SFT (CFPCallback's theta0 comes back from the checkpoint), LoRA
with CFP-KFAC under DPO (the adapter) and GRPO (its sampling); and on CFP-KFAC under SFT cut off while it saved its
last checkpoint (the Trainer's files written, the callbacks' not), which resumes from the checkpoint before."""

import shutil

import pytest
import torch
from support.extras import needs
from transformers import TrainerCallback

needs("trl", "datasets", "peft")

from longrun.plan import TINY  # noqa: E402
from longrun.run import LongRun  # noqa: E402
from longrun.training import CURVE_STATE, CurveCallback, last_whole_checkpoint, prepared_trainer, train_arm  # noqa: E402

KEYS = ("sft/kfac[math]@1/seed0", "dpo/lora_kfac[math_t2]@1/seed0", "grpo-pirate/unregularized@0/seed0")


class Interrupted(Exception):
    pass


class InterruptAfter(TrainerCallback):
    """Raises at the start of the step after `step`, once that step's checkpoint is written."""

    def __init__(self, step: int):
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise Interrupted


@pytest.fixture(scope="module")
def long_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("resume")
    arms = [arm for arm in TINY.arms() if arm.key in KEYS]
    return LongRun(TINY, "tiny", out, out / "anchors", arms), {arm.key: arm for arm in arms}


def assert_same_points(resumed: list[dict], whole: list[dict]):
    assert [p["step"] for p in resumed] == [p["step"] for p in whole]
    for got, want in zip(resumed, whole, strict=True):
        assert got.keys() == want.keys()
        for name, value in want.items():
            assert got[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name


def cut_off_mid_save(checkpoint) -> None:
    """Leave `checkpoint` as a save stopped after the Trainer's files: without the callbacks' (CFPCallback's
    theta0, the curve)."""
    trainer_files = {"config.json", "generation_config.json", "model.safetensors", "optimizer.pt", "scheduler.pt"}
    trainer_files |= {"rng_state.pth", "trainer_state.json", "training_args.bin"}
    for path in checkpoint.iterdir():
        if path.name not in trainer_files:
            path.unlink() if path.is_file() else shutil.rmtree(path)


@pytest.mark.parametrize(("key", "mid_save"), [(key, False) for key in KEYS] + [(KEYS[0], True)])
def test_an_interrupted_arm_resumes_from_its_last_checkpoint_and_ends_as_the_whole_run(
    long_run, tmp_path, key, mid_save
):
    run, arms = long_run
    arm = arms[key]
    anchors = run.store.for_arm(TINY.anchors_of(arm))
    measured = TINY.measured_steps(arm.optimizer)
    whole = train_arm(arm, run.factory, anchors, run.probe, tmp_path / "whole")

    cut_at, cut = measured[1], tmp_path / "cut"
    callbacks = [CurveCallback(run.probe, arm, measured), InterruptAfter(cut_at)]
    with pytest.raises(Interrupted):
        prepared_trainer(arm, run.factory, anchors, callbacks, cut).train()
    kept = [f"checkpoint-{step}" for step in measured[:2]]  # save_total_limit=2
    assert sorted(p.name for p in cut.glob("checkpoint-*")) == sorted(kept)
    assert (cut / kept[-1] / CURVE_STATE).exists()
    if mid_save:
        cut_off_mid_save(cut / kept[-1])
    assert last_whole_checkpoint(cut) == str(cut / kept[0 if mid_save else -1])

    resumed = train_arm(arm, run.factory, anchors, run.probe, cut)
    assert resumed.earlier_seconds > 0  # the seconds before the cut are counted
    assert [p["step"] for p in resumed.curve] == measured
    assert_same_points(resumed.curve, whole.curve)
    losses = [(e["step"], e["loss"]) for e in whole.history if "loss" in e]
    assert [(e["step"], pytest.approx(e["loss"], rel=1e-4)) for e in resumed.history if "loss" in e] == losses
    want = dict(whole.model.named_parameters())
    for name, parameter in resumed.model.named_parameters():
        torch.testing.assert_close(parameter, want[name], msg=name)
