"""Metrics reach the reporters: the automatic placement before them, and `CFPCallback.attach(trainer)`
for trainers whose callback handler the automatic placement cannot find; and why the automatic placement (and a
resume path given only to `train()`) needs the one stack walk."""

import json
import logging
import shutil

from support.tensorboard import read_scalars
from support.tiny import anchor_for, tiny_llama
from support.training import lm_dataset
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.integrations import TensorBoardCallback
from transformers.trainer_callback import CallbackHandler

import hf_cfp.integrations.callback as callback_module
from hf_cfp import CFPCallback
from hf_cfp.integrations.reporting import find_trainer_call
from hf_cfp.integrations.resume import public_checkpoint

KEYS = ("train/cfp/math/sensitive_drift", "train/cfp/math/free_drift", "train/cfp/total_drift")


def tensorboard_trainer(model, output_dir, callbacks=()):
    args = TrainingArguments(
        output_dir=str(output_dir),
        max_steps=3,
        per_device_train_batch_size=4,
        learning_rate=3e-2,
        use_cpu=True,
        report_to=["tensorboard"],
        logging_steps=1,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    return Trainer(model=model, args=args, train_dataset=lm_dataset(), callbacks=list(callbacks))


def positions(trainer, cfp):
    callbacks = trainer.callback_handler.callbacks
    reporter = next(i for i, cb in enumerate(callbacks) if isinstance(cb, TensorBoardCallback))
    return [i for i, cb in enumerate(callbacks) if cb is cfp], reporter


def test_attach_places_the_callback_once_before_the_first_reporter(tmp_path):
    model = tiny_llama()
    trainer = tensorboard_trainer(model, tmp_path)
    cfp = CFPCallback(anchor_for(model), lam=1.0).attach(trainer)
    mine, reporter = positions(trainer, cfp)
    assert len(mine) == 1 and mine[0] < reporter
    cfp.attach(trainer)  # attaching again neither duplicates nor moves it after the reporter
    mine, reporter = positions(trainer, cfp)
    assert len(mine) == 1 and mine[0] < reporter


def test_without_a_handler_on_the_stack_one_warning_names_attach(caplog):
    model = tiny_llama()
    cfp = CFPCallback(anchor_for(model), lam=1.0)
    with caplog.at_level(logging.WARNING, logger="hf_cfp.integrations.callback"):
        args = TrainingArguments(output_dir="unused", use_cpu=True, report_to="none")
        cfp.on_train_begin(args, TrainerState(), TrainerControl(), model=model)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "attach(trainer)" in warnings[0].getMessage()


def test_attach_makes_metrics_reach_tensorboard_when_the_handler_cannot_be_found(tmp_path, monkeypatch, caplog):
    """A trainer whose handler the stack walk cannot find (simulated): plain `callbacks=[...]` leaves the
    metrics to the console and history only; `attach(trainer)` brings them to TensorBoard."""
    monkeypatch.setattr(callback_module, "find_trainer_call", lambda callback: None)
    scalars = {}
    for arm in ("plain", "attached"):
        model = tiny_llama()
        cfp = CFPCallback(anchor_for(model), lam=1.0)
        if arm == "plain":
            trainer = tensorboard_trainer(model, tmp_path / arm, callbacks=[cfp])
        else:
            trainer = tensorboard_trainer(model, tmp_path / arm)
            cfp.attach(trainer)
        with caplog.at_level(logging.WARNING, logger="hf_cfp.integrations.callback"):
            trainer.train()
        history = [row for row in trainer.state.log_history if "loss" in row]
        assert all("cfp/total_drift" in row for row in history)  # the history has them either way
        scalars[arm] = read_scalars(tmp_path / arm)
    assert not any(key in scalars["plain"] for key in KEYS)
    for key in KEYS:
        assert [step for step, _ in scalars["attached"][key]] == [1, 2, 3]
    assert sum("attach(trainer)" in r.getMessage() for r in caplog.records) == 1  # the plain arm only


class RecordTrainBegin(TrainerCallback):
    """Keeps what the Trainer hands a callback at train begin, and what the stack walk finds from there."""

    def on_train_begin(self, args, state, control, **kwargs):
        self.args, self.state, self.control, self.kwargs = args, state, control, kwargs
        self.text = json.dumps([args.to_dict(), vars(state), vars(control)], default=str)  # as handed, not later
        self.step, self.public = state.global_step, public_checkpoint(args, state)
        self.found = find_trainer_call(self)


def test_no_event_carries_the_handler_or_the_resume_path_so_the_stack_walk_reads_them(tmp_path):
    """Why `find_trainer_call` exists: at train begin a callback receives `args`, `state`, `control` and keyword
    arguments, none of which is or holds the Trainer or its CallbackHandler (so `callbacks=[...]` cannot be
    reordered before the reporters from them), and a path given only to `train(resume_from_checkpoint=...)` is in
    none of them; the walk finds both."""
    model = tiny_llama()
    first = tensorboard_trainer(model, tmp_path / "first")
    first.args.save_strategy, first.args.save_steps = "steps", 2
    first.train()
    moved = tmp_path / "elsewhere" / "my-checkpoint"
    shutil.copytree(tmp_path / "first" / "checkpoint-3", moved)  # max_steps=3: the final step's checkpoint
    recorder = RecordTrainBegin()
    trainer = tensorboard_trainer(tiny_llama(), tmp_path / "fresh", callbacks=[recorder])
    trainer.train(resume_from_checkpoint=str(moved))

    handed = [recorder.args, recorder.state, recorder.control, *recorder.kwargs.values()]
    assert not any(isinstance(value, (Trainer, CallbackHandler)) for value in handed)
    attributes = [v for obj in handed if hasattr(obj, "__dict__") for v in vars(obj).values()]
    assert not any(isinstance(value, (Trainer, CallbackHandler)) for value in attributes)
    assert str(moved) not in recorder.text and "my-checkpoint" not in recorder.text
    assert "resume_from_checkpoint" not in recorder.kwargs and recorder.args.resume_from_checkpoint is None
    assert recorder.step == 3 and recorder.public is None  # resumed, yet no path the public lookup tries exists
    assert recorder.found is not None and recorder.found.handler is trainer.callback_handler
    assert recorder.found.resume_from_checkpoint == str(moved)
