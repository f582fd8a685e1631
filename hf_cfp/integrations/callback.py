"""CFPCallback: Cumulative Fisher Protection as a transformers TrainerCallback (thin glue over CFPState)."""

import logging
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..anchor import check_fingerprint
from ..errors import CFPArgumentError, CFPError
from ..ops.lora_correction import LORA_RULES
from ..parallel import refuse_unsupported_layout
from ..protection import CFPState, SavedTheta0, has_saved_theta0, peft_view, save_theta0
from .reporting import add_to_step_log, attach_before_reporters, find_trainer_call, place_at_train_begin
from .resolve import AnchorLike, PendingAnchor, load_anchor, resolve_anchor

logger = logging.getLogger(__name__)


class CFPCallback(TrainerCallback):
    r"""
    A [`~transformers.TrainerCallback`] that keeps training off the parameter directions a capability is
    sensitive to (Cumulative Fisher Protection).

    After every optimizer step (`on_step_end`), every parameter covered by `anchor` is pulled back toward its
    initial value theta0, coordinate by coordinate:

    $$\theta_{t+1} = \theta_0 + \frac{\theta' - \theta_0}{1 + \lambda_t F}$$

    where theta' is the optimizer's proposal and F the anchor's diagonal Fisher. Coordinates with F = 0 keep the
    proposal exactly; under a persistent step d the displacement converges to d / (lam F) instead of growing
    linearly. At every logging step it adds, for the protecting anchor and every monitor anchor,
    `cfp/<anchor>/sensitive_drift` = sqrt(sum F (theta - theta0)^2), `cfp/<anchor>/free_drift` =
    ||theta - theta0|| over the `free_fraction` of coordinates with the smallest F, and `cfp/total_drift` =
    ||theta - theta0||. They reach every logger in `report_to` and `state.log_history`: at train begin the
    callback places itself before the reporting callbacks; [`~CFPCallback.attach`] does the same explicitly.

    On a `peft.PeftModel` (LoRA) the anchor is keyed by the base model's names, and the metrics are those of the
    merged weights against the base weights (theta - theta0 = s B A - s0 B0 A0 on adapted weights). An adapted
    weight is corrected through its LoRA factors toward the same target (theta - theta0) / (1 + lam F), as far as
    the adapter can represent it (`lora_rule`); `cfp/<anchor>/adapter_residual` logs the share it missed.

    Args:
        anchor ([`FisherAnchor`], `str` or `os.PathLike`):
            The protecting anchor, a directory it was saved to, or a Hub reference `org/model@revision:subfolder`
            (revision and subfolder optional).
        lam (`float` or `Callable[[int], float]`, *optional*, defaults to `1.0`):
            The strength lam >= 0, or a schedule `step -> lam` called with the optimizer step just taken
            (1-based). Its meaning depends on the Fisher's scale: lam * F_i = 1 halves coordinate i's displacement
            each step (see the README on choosing lam). The paper uses 1 for PPO and 10 for DPO.
        monitor (sequence of [`FisherAnchor`], `str` or `os.PathLike`, *optional*, defaults to `()`):
            Anchors whose drift is logged but not corrected.
        free_fraction (`float`, *optional*, defaults to `0.99`):
            Share of coordinates, by smallest F, that `free_drift` runs over.
        compute_if_missing (prompts, *optional*):
            Calibration prompts (any form [`estimate_fisher`] takes) used when `anchor` is a reference that does
            not exist yet: the anchor is estimated at train begin on the model about to be trained.
        push_if_computed (`bool`, *optional*, defaults to `False`):
            Push an anchor computed that way to its reference (main process only).
        estimate_kwargs (`dict`, *optional*):
            More arguments for [`estimate_fisher`] (`num_sequences`, `max_new_tokens`, ...).
        strict (`bool`, *optional*, defaults to `True`):
            An anchor computed for another base model (its stored fingerprint differs from the model's names,
            shapes, dtypes or sampled weights) raises `AnchorMismatchError`; `False` downgrades that to a warning.
        restart_path_on_resume (`bool`, *optional*, defaults to `False`):
            Resuming from a checkpoint that has no saved theta0 (saved without CFP) raises `CFPError`; `True`
            takes theta0 from the resumed weights instead, so the protected path starts again there.
        lora_rule (`str`, *optional*, defaults to `"proximal_b"`):
            How a LoRA-adapted weight is corrected (PEFT models only): `"proximal_b"`, the exact proximal step
            restricted to B (A fixed); `"least_squares_b"`, its unweighted fit; `"factor_space"`, elementwise CFP
            on B and A with F pulled back through the adapter (cheaper, not exact). See `hf_cfp.ops.lora_correction`.

    Example:

    ```python
    from hf_cfp import CFPCallback, FisherAnchor, estimate_fisher

    anchor = estimate_fisher(model, tokenizer, math_prompts, name="math")
    trainer = DPOTrainer(model=model, args=args, train_dataset=ds, callbacks=[CFPCallback(anchor, lam=10.0)])
    trainer.train()
    ```
    """

    def __init__(
        self,
        anchor: AnchorLike,
        lam: float | Callable[[int], float] = 1.0,
        monitor: Sequence[AnchorLike] = (),
        free_fraction: float = 0.99,
        compute_if_missing: Any = None,
        push_if_computed: bool = False,
        estimate_kwargs: dict[str, Any] | None = None,
        strict: bool = True,
        restart_path_on_resume: bool = False,
        lora_rule: str = "proximal_b",
    ):
        self.anchor = resolve_anchor(anchor, compute_if_missing, push_if_computed, estimate_kwargs)
        self.monitors = [load_anchor(m) for m in monitor]
        names = [a.name for a in (self.anchor, *self.monitors)]
        if len(set(names)) != len(names):
            raise CFPArgumentError(f"Anchor names must be unique (they key the metrics), got {names}.")
        if not callable(lam):
            _check_lam(lam)
        if not 0 < free_fraction < 1:
            raise CFPArgumentError(f"free_fraction must be in (0, 1), got {free_fraction!r}; the paper uses 0.99.")
        self.lam = lam
        self.free_fraction = free_fraction
        self.strict = strict
        self.restart_path_on_resume = restart_path_on_resume
        if lora_rule not in LORA_RULES:
            raise CFPArgumentError(f"lora_rule must be one of {sorted(LORA_RULES)}, got {lora_rule!r}.")
        self.lora_rule = lora_rule
        self.protection: CFPState | None = None  # bound at train begin
        self._attached = False  # placed before the reporters by `attach`
        self._optimizer_size: tuple[int, int] | None = None  # (param groups, parameters) at bind

    def attach(self, trainer: Trainer) -> "CFPCallback":
        """Add this callback to `trainer` (if it is not there yet) just before its reporting callbacks.

        The explicit form of the placement done automatically at train begin, for trainers whose callback
        handler the automatic placement cannot find. Returns the callback.

        ```python
        cfp = CFPCallback(anchor, lam=10.0).attach(trainer)
        ```
        """
        attach_before_reporters(trainer, self)
        self._attached = True
        return self

    def lam_at(self, step: int) -> float:
        """lam_t for the optimizer step `step` (1-based), validated."""
        return _check_lam(self.lam(step) if callable(self.lam) else self.lam)

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        model = kwargs["model"]
        optimizer = kwargs.get("optimizer")
        if isinstance(self.anchor, PendingAnchor):
            self.anchor = self.anchor.compute(model, kwargs.get("processing_class"))
        anchor = self.anchor
        call = find_trainer_call(self)
        if self.protection is None or self.protection.model is not model:  # first train(), or another model
            refuse_unsupported_layout(model, args, optimizer)
            theta0 = None
            if state.global_step > 0:  # resumed: the original theta0 comes from the checkpoint
                theta0 = self._saved_theta0(args, state, call.resume_from_checkpoint if call else None)
            else:
                view = peft_view(model)  # a PeftModel is checked through its base model's names and weights
                for bound in (anchor, *self.monitors):
                    fingerprint = bound.metadata.get("base_fingerprint")
                    check_fingerprint(fingerprint, model, bound.name, self.strict, view.base if view else None)
            self.protection = CFPState(
                model, anchor, self.monitors, self.free_fraction, optimizer, theta0=theta0, lora_rule=self.lora_rule
            )
        self._optimizer_size = _optimizer_size(optimizer)  # each train() may bring its own optimizer
        if not self._attached:
            place_at_train_begin(self, call)

    def _saved_theta0(
        self, args: TrainingArguments, state: TrainerState, resumed_from: str | None
    ) -> SavedTheta0 | None:
        """The theta0 saved in the checkpoint being resumed: the path the Trainer resumes from, else
        `args.resume_from_checkpoint`, else `output_dir/checkpoint-<step>`. Without one, raise
        CFPError, or with `restart_path_on_resume=True` return None (theta0 = the resumed weights)."""
        explicit = getattr(args, "resume_from_checkpoint", None)  # a loop may pass no TrainingArguments
        checkpoint = resumed_from or (explicit if isinstance(explicit, str) else None)
        if checkpoint is None and getattr(args, "output_dir", None):
            checkpoint = _checkpoint_dir(args, state)
        if checkpoint is not None and has_saved_theta0(checkpoint):
            return SavedTheta0(checkpoint)
        if self.restart_path_on_resume:
            logger.info(
                "CFPCallback: no saved theta0 in %s; the protected path restarts at the resumed weights "
                "(restart_path_on_resume=True).",
                checkpoint,
            )
            return None
        raise CFPError(
            f"CFPCallback: resuming at step {state.global_step}, but the checkpoint {checkpoint!r} has no saved "
            "theta0 (cfp_theta0-rank*.safetensors), so the protected path would restart at the resumed weights. "
            "Resume from a checkpoint saved while CFPCallback was attached; if your trainer does not pass the path "
            "it resumes from, set TrainingArguments(resume_from_checkpoint=<that path>); or pass "
            "CFPCallback(..., restart_path_on_resume=True) to start the path again on purpose."
        )

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.protection is None:
            raise CFPError("CFPCallback.on_step_end before on_train_begin: the anchor was never bound to the model.")
        self._check_optimizer(kwargs.get("optimizer"))
        # DefaultFlowCallback, first in the handler, has already decided whether this step logs (a plain
        # loop driving the callback may pass no TrainerControl: then no adapter residual is measured)
        logs = bool(getattr(control, "should_log", False))
        self.protection.correct(self.lam_at(state.global_step), measure_residual=logs)

    def _check_optimizer(self, optimizer: torch.optim.Optimizer | None) -> None:
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
                "optimizer's parameters during training."
            )

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self.protection is not None:
            save_theta0(self.protection, _checkpoint_dir(args, state))

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        if self.protection is not None and logs is not None and "loss" in logs:
            add_to_step_log(state, logs, self.protection.drift_metrics())


def _optimizer_size(optimizer: torch.optim.Optimizer | None) -> tuple[int, int] | None:
    """(param groups, parameters) of a torch-style optimizer; None when it has no param_groups."""
    groups = getattr(optimizer, "param_groups", None)
    if groups is None:
        return None
    return len(groups), sum(len(g["params"]) for g in groups)


def _checkpoint_dir(args: TrainingArguments, state: TrainerState) -> str:
    """Where the Trainer writes (and by default resumes) the checkpoint of the current step."""
    return os.path.join(str(args.output_dir), f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")


def _check_lam(lam: Any) -> float:
    if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not math.isfinite(lam) or lam < 0:
        raise CFPArgumentError(f"lam must be a finite number >= 0 (or a schedule returning one), got {lam!r}.")
    return float(lam)
