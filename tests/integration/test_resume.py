"""Resuming from a checkpoint keeps the original theta0: bit-identical to an uninterrupted run."""

import shutil

import pytest
import torch
from support.anchors import random_anchor
from support.tiny import tiny_llama
from support.training import lm_dataset
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_cfp import CFPCallback


class Crash(TrainerCallback):
    """Stops the run with an exception after `step` (the checkpoint of that step is already saved)."""

    def __init__(self, step):
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise KeyboardInterrupt("simulated crash")


def run(output_dir, extra=(), resume=None):
    model = tiny_llama()
    anchors = dict(anchor=random_anchor(model, "math", seed=1), monitor=[random_anchor(model, "code", seed=2)])
    args = TrainingArguments(
        output_dir=str(output_dir),
        max_steps=6,
        save_steps=2,
        save_total_limit=1,
        per_device_train_batch_size=4,
        learning_rate=3e-2,
        use_cpu=True,
        report_to="none",
        logging_steps=1,
        seed=0,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=lm_dataset(),
        callbacks=[CFPCallback(lam=lambda step: 2.0 * step, **anchors), *extra],
    )
    trainer.train(resume_from_checkpoint=resume)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, trainer.state.log_history


def test_resumed_run_is_bit_identical_to_the_uninterrupted_one(tmp_path):
    straight, straight_logs = run(tmp_path / "straight")
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "crashed", extra=[Crash(step=4)])
    checkpoints = sorted(p.name for p in (tmp_path / "crashed").glob("checkpoint-*"))
    assert checkpoints == ["checkpoint-4"]  # save_total_limit=1 rotated checkpoint-2 away
    assert (tmp_path / "crashed" / "checkpoint-4" / "cfp_theta0.safetensors").is_file()

    bare = tmp_path / "bare" / "checkpoint-4"  # the same checkpoint, as saved without CFPCallback
    shutil.copytree(tmp_path / "crashed" / "checkpoint-4", bare)
    (bare / "cfp_theta0.safetensors").unlink()

    resumed, resumed_logs = run(tmp_path / "crashed", resume=True)
    assert all(torch.equal(resumed[n], straight[n]) for n in straight)
    last = {k: v for k, v in straight_logs[-2].items() if k.startswith("cfp/")}
    assert len(last) == 5 and last == {k: resumed_logs[-2][k] for k in last}

    # Without the saved theta0 the path restarts at the checkpoint's weights (with a warning): another run.
    restarted, _ = run(tmp_path / "bare", resume=str(bare))
    assert max((restarted[n] - straight[n]).abs().max().item() for n in straight) > 1e-4
