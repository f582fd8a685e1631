"""CFPCallback: Cumulative Fisher Protection as a transformers TrainerCallback (thin glue)."""

import logging
import math
import os
from collections.abc import Callable, Sequence

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .anchor import FisherAnchor
from .checkpoint import load_theta0, save_theta0
from .distributed import refuse_unsupported_layout
from .errors import CFPArgumentError, CFPError
from .fingerprint import check_fingerprint
from .protection import CFPState
from .reporting import add_to_step_log, place_before_reporters
from .resolve import PendingAnchor, resolve_anchor

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

    Anchors can come from the Hub: ``CFPCallback("org/model@main:cfp/math", lam=10.0)``
    (``repo@revision:subfolder``; revision and subfolder optional). With
    ``compute_if_missing=prompts`` an anchor the Hub does not have is estimated at train begin
    on the model about to be trained, and pushed there if ``push_if_computed``.

    Args:
        anchor: the protecting FisherAnchor, a directory it was saved to, or a Hub reference.
        lam: the strength lam >= 0, or a callable ``step -> lam`` called with the optimizer step
            just taken (1-based). Its meaning depends on the Fisher's scale: lam * F_i = 1 halves
            coordinate i's displacement each step (see the README on choosing lam).
            The paper uses 1 for PPO and 10 for DPO.
        monitor: anchors (or directories) whose drift is logged but not corrected.
        free_fraction: share of coordinates, by smallest F, that ``free_drift`` runs over.
        compute_if_missing: calibration prompts (any form `estimate_fisher` takes) used when
            `anchor` is a reference that does not exist yet.
        push_if_computed: push an anchor computed that way to its reference (main process only).
        estimate_kwargs: more arguments for `estimate_fisher` (num_sequences, max_new_tokens, ...).
        strict: an anchor computed for another base model (its stored fingerprint differs from
            the model's names, shapes, dtypes or sampled weights) raises AnchorMismatchError;
            False downgrades that to a warning.
    """

    def __init__(
        self,
        anchor: FisherAnchor | str | os.PathLike,
        lam: float | Callable[[int], float] = 1.0,
        monitor: Sequence[FisherAnchor | str | os.PathLike] = (),
        free_fraction: float = 0.99,
        compute_if_missing=None,
        push_if_computed: bool = False,
        estimate_kwargs: dict | None = None,
        strict: bool = True,
    ):
        self.anchor = resolve_anchor(anchor, compute_if_missing, push_if_computed, estimate_kwargs)
        self.monitors = [resolve_anchor(m) for m in monitor]
        names = [a.name for a in (self.anchor, *self.monitors)]
        if len(set(names)) != len(names):
            raise CFPArgumentError(f"Anchor names must be unique (they key the metrics), got {names}.")
        if not callable(lam):
            _check_lam(lam)
        if not 0 < free_fraction < 1:
            raise CFPArgumentError(f"free_fraction must be in (0, 1), got {free_fraction!r}; the paper uses 0.99.")
        self.lam, self.free_fraction, self.strict = lam, free_fraction, strict
        self.state: CFPState | None = None
        self._optimizer_size: tuple[int, int] | None = None  # (param groups, parameters) at bind

    def lam_at(self, step: int) -> float:
        """lam_t for the optimizer step `step` (1-based), validated."""
        return _check_lam(self.lam(step) if callable(self.lam) else self.lam)

    def on_train_begin(self, args, state, control, model=None, processing_class=None, **kwargs):
        if isinstance(self.anchor, PendingAnchor):
            self.anchor = self.anchor.compute(model, processing_class)
        if self.state is None or self.state.model is not model:  # first train(), or reused with another model
            refuse_unsupported_layout(model, args, kwargs.get("optimizer"))
            theta0 = None
            if state.global_step > 0:  # resumed: the original theta0 comes from the checkpoint
                theta0 = load_theta0(_checkpoint_dir(args, state))
                if theta0 is None:
                    logger.warning(
                        "CFPCallback: resuming at step %d from a checkpoint without cfp_theta0: theta0 is taken "
                        "from the resumed weights, so the path restarts there.", state.global_step)
            else:
                for anchor in (self.anchor, *self.monitors):
                    check_fingerprint(anchor.metadata.get("base_fingerprint"), model, anchor.name, self.strict)
            self.state = CFPState(model, self.anchor, self.monitors, self.free_fraction, kwargs.get("optimizer"),
                                  theta0=theta0)
        self._optimizer_size = _optimizer_size(kwargs.get("optimizer"))  # each train() may bring its own optimizer
        place_before_reporters(self)

    def on_step_end(self, args, state, control, **kwargs):
        self._check_optimizer(kwargs.get("optimizer"))
        self.state.correct(self.lam_at(state.global_step))

    def _check_optimizer(self, optimizer) -> None:
        """Refuse parameters added to the optimizer after bind: theta0 and F were taken for the
        parameters the optimizer had then, so new ones would be trained unprotected and unmeasured.
        O(param groups) per step. A step skipped by the fp16 grad scaler is still corrected: the
        Trainer calls on_step_end for it, and the pull is that of a zero optimizer step."""
        size = _optimizer_size(optimizer)
        if size is None:
            return
        if self._optimizer_size is None:  # the optimizer was not passed at train begin: first step binds it
            self._optimizer_size = size
        elif size != self._optimizer_size:
            (groups0, params0), (groups, params) = self._optimizer_size, size
            raise CFPError(
                f"CFPCallback: the optimizer now has {params} parameters in {groups} param groups, but had {params0} "
                f"in {groups0} when CFP bound its anchors at train begin ({params - params0:+d} parameters, "
                f"{groups - groups0:+d} groups). Parameters added after bind would be neither protected nor measured: "
                "add every parameter to the model and the optimizer before trainer.train(), and do not change the "
                "optimizer's parameters during training.")

    def on_save(self, args, state, control, **kwargs):
        if self.state is not None:
            save_theta0(self.state, _checkpoint_dir(args, state))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.state is not None and logs is not None and "loss" in logs:
            add_to_step_log(state, logs, self.state.drift_metrics())


def _optimizer_size(optimizer) -> tuple[int, int] | None:
    """(param groups, parameters) of a torch-style optimizer; None when it has no param_groups."""
    groups = getattr(optimizer, "param_groups", None)
    if groups is None:
        return None
    return len(groups), sum(len(g["params"]) for g in groups)


def _checkpoint_dir(args, state) -> str:
    """Where the Trainer writes (and by default resumes) the checkpoint of the current step."""
    return os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")


def _check_lam(lam) -> float:
    if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not math.isfinite(lam) or lam < 0:
        raise CFPArgumentError(f"lam must be a finite number >= 0 (or a schedule returning one), got {lam!r}.")
    return float(lam)
