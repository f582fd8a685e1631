"""Let metrics added in `on_log` reach every reporting integration.

The Trainer orders its callbacks DefaultFlowCallback, reporters (`report_to`), user callbacks,
printer, and hands each the same `logs` dict in turn; `state.log_history` is appended before.
So a user callback's keys would miss TensorBoard, W&B, ... and the history. At train begin the
CFP callback finds the CallbackHandler that is calling it and moves itself just before the
first reporter; in `on_log` it also updates the history entry of that step.
"""

import logging
import sys

from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK
from transformers.trainer_callback import CallbackHandler

logger = logging.getLogger(__name__)
_REPORTERS = tuple(INTEGRATION_TO_CALLBACK.values())


def _calling_handler(callback, max_depth: int = 16) -> CallbackHandler | None:
    frame = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, CallbackHandler) and any(cb is callback for cb in owner.callbacks):
            return owner
        frame = frame.f_back
    return None


def place_before_reporters(callback) -> None:
    """Move `callback` just before the first reporting integration of the handler calling it."""
    handler = _calling_handler(callback)
    if handler is None:
        logger.warning(
            "%s could not find the Trainer's callback handler; its metrics reach the console and "
            "state.log_history only. Pass reporting callbacks after it to log them elsewhere.",
            type(callback).__name__,
        )
        return
    callbacks = handler.callbacks
    first_reporter = next((i for i, cb in enumerate(callbacks) if isinstance(cb, _REPORTERS)), len(callbacks))
    if first_reporter < callbacks.index(callback):
        others = [cb for cb in callbacks if cb is not callback]
        # A new list: the handler may be iterating over the old one right now.
        handler.callbacks = others[:first_reporter] + [callback] + others[first_reporter:]


def add_to_step_log(state, logs: dict, metrics: dict) -> None:
    """Add `metrics` to the `logs` being dispatched and to the history entry of the same step."""
    logs.update(metrics)
    if state.log_history and state.log_history[-1].get("step") == state.global_step:
        state.log_history[-1].update(metrics)
