"""Let metrics added in `on_log` reach every reporting integration.

The Trainer orders its callbacks DefaultFlowCallback, reporters (`report_to`), user callbacks,
printer, and hands each the same `logs` dict in turn; `state.log_history` is appended before.
So a user callback's keys would miss TensorBoard, W&B, ... and the history. Two ways to move
the callback just before the first reporter:

- explicit, the public way: `move_before_reporters(trainer.callback_handler, callback)`, which
  `CFPCallback.attach(trainer)` calls;
- automatic, for `callbacks=[...]`: at train begin the callback finds the CallbackHandler that is calling it
  (`find_trainer_call`).

`find_trainer_call` is the library's one walk over stack frames, a fallback kept because no public path
exists: a callback's events receive `args`, `state`, `control` and the model, optimizer, scheduler, dataloaders
and processing class, but neither the Trainer nor its CallbackHandler, so a callback handed to `Trainer(...,
callbacks=[...])` cannot reach the handler's list to reorder it; nor do they carry the checkpoint path given to
`trainer.train(resume_from_checkpoint=<path>)` (tests/integration/test_placement.py shows both). The same walk
reads that path, which is used only when `args.resume_from_checkpoint` and `output_dir/checkpoint-<step>` name no
checkpoint (`resume.public_checkpoint`). It runs at most once per train begin, and not at all for an attached
callback that starts fresh or resumes from output_dir.

In `on_log` the callback also updates the history entry of that step (`add_to_step_log`).
"""

import os
import sys
from dataclasses import dataclass
from types import FrameType

from transformers import Trainer, TrainerCallback, TrainerState
from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK
from transformers.trainer_callback import CallbackHandler
from transformers.utils import logging

from ..parallel import log_on_main_process

_REPORTERS = tuple(INTEGRATION_TO_CALLBACK.values())

logger = logging.get_logger(__name__)


@dataclass(frozen=True)
class TrainerCall:
    """The Trainer call that fired the current callback event."""

    handler: CallbackHandler  # dispatches the events; holds `callback`
    resume_from_checkpoint: str | None  # the checkpoint this `train()` resumes from (resolved), if known


def find_trainer_call(callback: TrainerCallback, max_depth: int = 16) -> TrainerCall | None:
    """The fallback for what a callback's events do not carry (module docstring): walk up at most `max_depth`
    frames of the call stack to the CallbackHandler whose callbacks include `callback`, and above it the Trainer
    method that called the handler, whose `resume_from_checkpoint` local holds the checkpoint path (`True` already
    resolved to the latest checkpoint). None without a handler (a plain loop driving the callback)."""
    frame: FrameType | None = sys._getframe(1)
    handler = None
    for _ in range(max_depth):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        if handler is None and isinstance(owner, CallbackHandler) and any(cb is callback for cb in owner.callbacks):
            handler = owner
        elif handler is not None and isinstance(owner, Trainer):
            resume = frame.f_locals.get("resume_from_checkpoint")
            return TrainerCall(handler, os.fspath(resume) if isinstance(resume, (str, os.PathLike)) else None)
        frame = frame.f_back
    return TrainerCall(handler, None) if handler is not None else None


def move_before_reporters(handler: CallbackHandler, callback: TrainerCallback) -> None:
    """Place `callback` (already in `handler`) just before the handler's first reporting integration."""
    callbacks = handler.callbacks
    first_reporter = next((i for i, cb in enumerate(callbacks) if isinstance(cb, _REPORTERS)), len(callbacks))
    if first_reporter < callbacks.index(callback):
        others = [cb for cb in callbacks if cb is not callback]
        # A new list: the handler may be iterating over the old one right now.
        handler.callbacks = others[:first_reporter] + [callback] + others[first_reporter:]


def add_to_step_log(state: TrainerState, logs: dict[str, float], metrics: dict[str, float]) -> None:
    """Add `metrics` to the `logs` being dispatched and to the history entry of the same step."""
    logs.update(metrics)
    if state.log_history and state.log_history[-1].get("step") == state.global_step:
        state.log_history[-1].update(metrics)


def attach_before_reporters(trainer: Trainer, callback: TrainerCallback) -> None:
    """Add `callback` to `trainer` (if it is not there yet) just before its reporting callbacks."""
    handler = trainer.callback_handler
    if not any(cb is callback for cb in handler.callbacks):
        trainer.add_callback(callback)
    move_before_reporters(handler, callback)


def place_at_train_begin(callback: TrainerCallback, call: TrainerCall | None) -> None:
    """The automatic placement: move `callback` before the reporters of the handler found on the
    stack (`find_trainer_call`), or warn once that its metrics reach the console and history only."""
    if call is not None:
        move_before_reporters(call.handler, callback)
        return
    log_on_main_process(
        logger.warning_once,
        "%s could not find the Trainer's callback handler: its metrics reach the console and "
        "state.log_history only. Call `callback.attach(trainer)` before trainer.train() to place it "
        "before the reporting callbacks.",
        type(callback).__name__,
    )
