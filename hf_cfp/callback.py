"""CFPCallback: Cumulative Fisher Protection as a transformers TrainerCallback (thin glue)."""

import logging
import math
import os
from collections.abc import Callable, Sequence

from transformers import TrainerCallback

from .anchor import FisherAnchor
from .errors import CFPArgumentError
from .protection import CFPState
from .reporting import add_to_step_log, place_before_reporters

logger = logging.getLogger(__name__)


class CFPCallback(TrainerCallback):
    r"""Keep training off the parameter directions a capability is sensitive to.

    After every optimizer step (``on_step_end``), every parameter covered by ``anchor`` is
    pulled back toward its initial value theta0, coordinate by coordinate:

        theta_{t+1} = theta0 + (theta' - theta0) / (1 + lam_t * F)

    where theta' is the optimizer's proposal and F the anchor's diagonal Fisher. Coordinates
    with F = 0 keep the proposal exactly; under a persistent step d the displacement converges
    to d / (lam F) instead of growing linearly. At every logging step it adds, for the
    protecting anchor and every monitor anchor, ``cfp/<anchor>/sensitive_drift`` =
    sqrt(sum F (theta - theta0)^2), ``cfp/<anchor>/free_drift`` = ||theta - theta0|| over the
    ``free_fraction`` of coordinates with the smallest F, and ``cfp/total_drift`` =
    ||theta - theta0||. They reach every logger in ``report_to`` and ``state.log_history``.

    Example::

        from hf_cfp import CFPCallback, FisherAnchor, estimate_fisher

        anchor = estimate_fisher(model, tokenizer, math_prompts, name="math")
        trainer = DPOTrainer(model=model, args=args, train_dataset=ds,
                             callbacks=[CFPCallback(anchor, lam=10.0)])
        trainer.train()

    Args:
        anchor: the protecting FisherAnchor, or the directory it was saved to.
        lam: the strength lam >= 0, or a callable ``step -> lam`` called with the optimizer step
            just taken (1-based). Its meaning depends on the Fisher's scale: lam * F_i = 1 halves
            coordinate i's displacement each step (see the README on choosing lam).
            The paper uses 1 for PPO and 10 for DPO.
        monitor: anchors (or directories) whose drift is logged but not corrected.
        free_fraction: share of coordinates, by smallest F, that ``free_drift`` runs over.
    """

    def __init__(
        self,
        anchor: FisherAnchor | str | os.PathLike,
        lam: float | Callable[[int], float] = 1.0,
        monitor: Sequence[FisherAnchor | str | os.PathLike] = (),
        free_fraction: float = 0.99,
    ):
        self.anchor = _as_anchor(anchor)
        self.monitors = [_as_anchor(m) for m in monitor]
        names = [a.name for a in (self.anchor, *self.monitors)]
        if len(set(names)) != len(names):
            raise CFPArgumentError(f"Anchor names must be unique (they key the metrics), got {names}.")
        if not callable(lam):
            _check_lam(lam)
        if not 0 < free_fraction < 1:
            raise CFPArgumentError(f"free_fraction must be in (0, 1), got {free_fraction!r}; the paper uses 0.99.")
        self.lam, self.free_fraction = lam, free_fraction
        self.state: CFPState | None = None

    def lam_at(self, step: int) -> float:
        """lam_t for the optimizer step `step` (1-based), validated."""
        return _check_lam(self.lam(step) if callable(self.lam) else self.lam)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.state is None or self.state.model is not model:  # first train(), or reused with another model
            if state.global_step > 0:
                logger.warning(
                    "CFPCallback: resuming at step %d, theta0 is taken from the resumed weights, not the "
                    "original ones, so the path restarts there. Exact resume is not supported yet.",
                    state.global_step,
                )
            self.state = CFPState(model, self.anchor, self.monitors, self.free_fraction)
        place_before_reporters(self)

    def on_step_end(self, args, state, control, **kwargs):
        self.state.correct(self.lam_at(state.global_step))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.state is not None and logs is not None and "loss" in logs:
            add_to_step_log(state, logs, self.state.drift_metrics())


def _as_anchor(anchor) -> FisherAnchor:
    return anchor if isinstance(anchor, FisherAnchor) else FisherAnchor.from_pretrained(anchor)


def _check_lam(lam) -> float:
    if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not math.isfinite(lam) or lam < 0:
        raise CFPArgumentError(f"lam must be a finite number >= 0 (or a schedule returning one), got {lam!r}.")
    return float(lam)
