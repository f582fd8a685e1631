"""Let metrics added in `on_log` reach every reporting integration.

The Trainer orders its callbacks DefaultFlowCallback, reporters (`report_to`), user callbacks,
printer, and hands each the same `logs` dict in turn; `state.log_history` is appended before.
So a user callback's keys would miss TensorBoard, W&B, ... and the history. Two ways to move
the callback just before the first reporter:

- explicit: `move_before_reporters(trainer.callback_handler, callback)`, which
  `CFPCallback.attach(trainer)` calls;
- automatic: at train begin the callback finds the CallbackHandler that is calling it
  (`calling_handler`, the one place that walks stack frames, a transformers internal).

In `on_log` the callback also updates the history entry of that step (`add_to_step_log`).
"""

import sys
from types import FrameType

from transformers import TrainerCallback, TrainerState
from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK
from transformers.trainer_callback import CallbackHandler

_REPORTERS = tuple(INTEGRATION_TO_CALLBACK.values())


def calling_handler(callback: TrainerCallback, max_depth: int = 16) -> CallbackHandler | None:
    """The CallbackHandler up the call stack whose callbacks include `callback`, or None."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, CallbackHandler) and any(cb is callback for cb in owner.callbacks):
            return owner
        frame = frame.f_back
    return None


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
