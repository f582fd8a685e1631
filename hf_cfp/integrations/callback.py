"""CFPCallback: Cumulative Fisher Protection as a transformers TrainerCallback (glue over the loop API, `CFP`)."""

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.utils import logging

from ..anchor import FisherAnchor, check_fingerprint
from ..errors import CFPError, plural
from ..parallel import refuse_unsupported_layout
from ..protection import CFPState, peft_view, save_theta0
from .kl_control import STATE_FILE as KL_STATE_FILE
from .kl_control import saved_state as saved_kl_state
from .loop import CFP, anchor_list
from .options import CALLBACK, LOOP, ProtectionOptions
from .recheck import AnchorRecheck
from .reporting import add_to_step_log, attach_before_reporters, find_trainer_call, place_at_train_begin
from .resolve import AnchorLike, PendingAnchor, load_anchor, resolve_anchor
from .resume import checkpoint_dir, public_checkpoint, saved_theta0
from .settings import ProtectionSettings
from .strength import LamSchedule, first_lr
from .surfaces import documents_options, option_entries
from .trace import tag_model, write_provenance

logger = logging.get_logger(__name__)


@documents_options(option_entries(CALLBACK))
class CFPCallback(TrainerCallback):
    r"""
    A [`~transformers.TrainerCallback`] that keeps training off the parameter directions a capability is
    sensitive to (Cumulative Fisher Protection).

    After every optimizer step (`on_step_end`), every parameter covered by a protecting anchor is pulled back
    toward its initial value theta0, coordinate by coordinate:

    $$\theta_{t+1} = \theta_0 + \frac{\theta' - \theta_0}{1 + \sum_k \lambda_{k,t} F_k}$$

    where theta' is the optimizer's proposal and F_k the diagonal Fisher of protecting anchor k (one anchor:
    1 + lam F): the proximal step of the summed penalties, in one pass. Coordinates with F = 0 keep the proposal
    exactly; under a persistent step d the displacement converges to d / (lam F) instead of growing linearly.
    At every logging step it adds, for every protecting and monitor anchor, `cfp/<anchor>/sensitive_drift` =
    sqrt(sum F (theta - theta0)^2), `cfp/<anchor>/predicted_kl` = sensitive_drift^2 / 2 (the second-order
    KL(mu_0 || mu_theta) on the anchor's calibration prompts, nats), `cfp/<anchor>/free_drift` =
    ||theta - theta0|| over the `free_fraction` of coordinates with the smallest F, `cfp/total_drift` =
    ||theta - theta0||, and `cfp/<anchor>/lam`, the lam_t of the step, per protecting anchor. They reach every
    logger in `report_to` and `state.log_history`: at train begin the callback places itself before the
    reporting callbacks; [`~CFPCallback.attach`] does the same explicitly.

    On a `peft.PeftModel` (LoRA) the anchor is keyed by the base model's names, and the metrics are those of the
    merged weights against the base weights (theta - theta0 = s B A - s0 B0 A0 on adapted weights). An adapted
    weight is corrected through its LoRA factors toward the same target (theta - theta0) / (1 + lam F), as far as
    the adapter can represent it (`lora_rule`); `cfp/<anchor>/adapter_residual` logs the share it missed.

    Args:

    Example:

    ```python
    from hf_cfp import CFPCallback, FisherAnchor, estimate_fisher

    anchor = estimate_fisher(model, tokenizer, math_prompts, name="math")
    trainer = DPOTrainer(model=model, args=args, train_dataset=ds, callbacks=[CFPCallback(anchor, lam=10.0)])
    trainer.train()
    ```
    """

    def __init__(  # the options CFPCallback takes, as declared (`options.signature_of(CALLBACK)`; tested)
        self,
        anchor: AnchorLike | Sequence[AnchorLike],
        lam: float | Sequence[float] | LamSchedule | None = None,
        *,
        kl_budget: float | Sequence[float] | None = None,
        kl_prompts: Any = None,
        kl_every: int = 8,
        kl_control: str = "feedforward",
        predicted_kl_budget: float | Sequence[float] | None = None,
        scale_lam_with_lr: bool = False,
        monitor: Sequence[AnchorLike] = (),
        free_fraction: float = 0.99,
        fisher_dtype: str = "float32",
        sparse: float | None = None,
        sparse_by: str = "coordinates",
        lora_rule: str = "proximal_b",
        strict: bool = True,
        restart_path_on_resume: bool = False,
        compute_if_missing: Any = None,
        push_if_computed: bool = False,
        estimate_kwargs: dict[str, Any] | None = None,
        recheck_every: int | None = None,
        recheck_prompts: Any = None,
        refresh_fisher: bool = False,
    ) -> None:
        options = ProtectionOptions.of_call(CALLBACK, locals())
        self.options = options
        self.anchors = [
            resolve_anchor(a, options.compute_if_missing, options.push_if_computed, options.estimate_kwargs)
            for a in anchor_list(options.anchor)
        ]
        monitors = [load_anchor(m) for m in options.monitor]
        self.settings = ProtectionSettings.of(options, [a.name for a in self.anchors], monitors)
        self.cfp: CFP | None = None  # bound at train begin
        self._attached = False  # placed before the reporters by `attach`
        self._optimizer_size: tuple[int, int] | None = None  # (param groups, parameters) at bind
        self._step_lr: float | None = None  # the learning rate of the optimizer step being taken
        self._rechecked: dict[str, float] = {}  # top1_overlap_now values for the next log
        self._kl_state: dict[str, Any] | None = None  # kl_budget's controller at the checkpoint resumed from

    @property
    def strict(self) -> bool:
        """Whether an anchor of another base model is an error (else a warning)."""
        return self.options.strict

    @property
    def restart_path_on_resume(self) -> bool:
        """Whether resuming without a saved theta0 restarts the protected path (else an error)."""
        return self.options.restart_path_on_resume

    @property
    def recheck(self) -> AnchorRecheck:
        """When and on which prompts the protecting anchors are re-estimated (`recheck_every`)."""
        return self.settings.recheck

    @property
    def protection(self) -> CFPState | None:
        """The bound state (theta0, F, the correction and the metrics) once training has begun, else None."""
        return self.cfp.protection if self.cfp is not None else None

    @property
    def monitors(self) -> list[FisherAnchor]:
        """The monitor anchors (measured, not corrected)."""
        return list(self.settings.monitors)

    @property
    def anchor(self) -> FisherAnchor | PendingAnchor:
        """The (first) protecting anchor."""
        return self.anchors[0]

    def attach(self, trainer: Trainer) -> "CFPCallback":
        """Add this callback to `trainer` (if it is not there yet) just before its reporting callbacks.

        The explicit form of the placement done automatically at train begin, for trainers whose callback
        handler the automatic placement cannot find.

        Args:
            trainer ([`~transformers.Trainer`]): the trainer (or a TRL trainer) to protect.

        Returns:
            [`CFPCallback`]: this callback, for chaining.

        ```python
        cfp = CFPCallback(anchor, lam=10.0).attach(trainer)
        ```
        """
        attach_before_reporters(trainer, self)
        self._attached = True
        return self

    def lam_at(self, step: int) -> list[float]:
        """lam_t of each protecting anchor for the optimizer step `step`, validated.

        Args:
            step (`int`): the optimizer step (1-based).

        Returns:
            `list[float]`: one lam_t per protecting anchor.

        Raises:
            CFPError: before training with `kl_budget`, `predicted_kl_budget` or `scale_lam_with_lr` (lam_t then
                depends on the step).
            CFPArgumentError: a schedule returned a bad value.
        """
        strength = self.settings.strength
        varies = strength.kl_budget is not None or strength.predicted_kl_budget is not None or strength.scale_with_lr
        if self.protection is None and varies:
            raise CFPError(
                "lam_at: with kl_budget, predicted_kl_budget or scale_lam_with_lr, lam_t is known only during "
                "training."
            )
        return strength.lams(step, self._step_lr, self.protection)  # type: ignore[arg-type]

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        model = kwargs["model"]
        optimizer = kwargs.get("optimizer")
        self.anchors = [
            a.compute(model, kwargs.get("processing_class")) if isinstance(a, PendingAnchor) else a
            for a in self.anchors
        ]
        anchors: list[FisherAnchor] = self.anchors  # type: ignore[assignment]  # none pending any more
        resumed_from = public_checkpoint(args, state) if state.global_step > 0 else None
        # the stack walk, only for what no argument of this event tells (`reporting.find_trainer_call`)
        needs_walk = not self._attached or (state.global_step > 0 and resumed_from is None)
        call = find_trainer_call(self) if needs_walk else None
        if self.cfp is None or self.cfp.protection.model is not model:  # first train(), or another model
            refuse_unsupported_layout(model, args, optimizer)
            theta0 = None
            if state.global_step > 0:  # resumed: the original theta0 comes from the checkpoint
                resumed_from = resumed_from or (call.resume_from_checkpoint if call else None)
                theta0 = saved_theta0(args, state, resumed_from, self.restart_path_on_resume)
            else:
                view = peft_view(model)  # a PeftModel is checked through its base model's names and weights
                for bound in (*anchors, *self.monitors):
                    fingerprint = bound.metadata.get("base_fingerprint")
                    check_fingerprint(fingerprint, model, bound.name, self.strict, view.base if view else None)
            kl_prompts = self._kl_prompts(model, kwargs.get("processing_class"), resumed_from, state.global_step)
            options = replace(
                self.options,
                anchor=anchors,
                monitor=self.monitors,
                optimizer=optimizer,
                theta0=theta0,
                kl_prompts=kl_prompts,
            )
            self.cfp = CFP(model, **options.arguments(LOOP))
            if self._kl_state is not None and self.cfp.control is not None:  # resumed under kl_budget
                self.cfp.protection.lams = self.cfp.control.restore(self._kl_state)
            strength = self.settings.strength  # per process: under sharding each describes the coordinates it holds
            logger.info(strength.describe(self.cfp.protection, getattr(args, "learning_rate", None)))
            if self.cfp.protection.sparse_report is not None:
                logger.info(strength.describe_sparse(self.cfp.protection))
            tag_model(model, anchors)  # the Hub card's tags (`trace`)
        self._optimizer_size = _optimizer_size(optimizer)  # each train() may bring its own optimizer
        if not self._attached:
            place_at_train_begin(self, call)

    def _kl_prompts(self, model, tokenizer, resumed_from: str | None, step: int) -> Any:
        """kl_prompts as base responses per anchor (`kl_control`): drawn now from the base model, or on resume the
        checkpoint's (with the controller's state, kept in `_kl_state`); the option as given without kl_budget.

        Raises:
            CFPError: resuming under kl_budget from a checkpoint without its state (unless restart_path_on_resume).
        """
        measurement, self._kl_state = self.settings.kl_measurement, None
        if measurement is None:
            return self.options.kl_prompts
        saved = saved_kl_state(resumed_from) if step > 0 else None
        if saved is not None:
            self._kl_state = saved
            return measurement.with_saved(saved).prompts
        if step > 0 and not self.restart_path_on_resume:
            raise CFPError(
                f"CFPCallback: resuming at step {step} under kl_budget, but the checkpoint {resumed_from!r} has no "
                f"{KL_STATE_FILE} (the base responses the KL is measured on, and lam_t). Resume from a checkpoint "
                "saved while CFPCallback was attached, or pass restart_path_on_resume=True to measure from the "
                "resumed weights on purpose."
            )
        return measurement.drawn(model, tokenizer).prompts

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.cfp is None:
            raise CFPError("CFPCallback.on_step_end before on_train_begin: the anchor was never bound to the model.")
        self._check_optimizer(kwargs.get("optimizer"))
        # DefaultFlowCallback, first in the handler, has already decided whether this step logs (a plain
        # loop driving the callback may pass no TrainerControl: then no adapter residual is measured)
        logs = bool(getattr(control, "should_log", False))
        self.cfp.step(state.global_step, self._step_lr or first_lr(kwargs.get("optimizer")), measure_residual=logs)
        if self.recheck.due(state.global_step):
            originals: list[FisherAnchor] = self.anchors  # type: ignore[assignment]  # bound at train begin
            self._rechecked, fresh = self.recheck.run(originals, kwargs["model"], kwargs.get("processing_class"))
            if fresh is not None:  # refresh F, keep theta0 (and lam_t's warm start)
                self.cfp.refresh(fresh)

    def on_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # after optimizer.step() and before the scheduler moves on: the learning rate this step was taken with
        self._step_lr = first_lr(kwargs.get("optimizer"))

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
                f"CFPCallback: the optimizer now has {plural(params, 'parameter')} in "
                f"{plural(groups, 'param group')}, but had {params0} in {groups0} when CFP bound its anchors at train "
                f"begin ({plural(params - params0, 'parameter', '+d')}, {plural(groups - groups0, 'group', '+d')}). "
                "Parameters added after bind would be neither protected nor measured: "
                "add every parameter to the model and the optimizer before trainer.train(), and do not change the "
                "optimizer's parameters during training."
            )

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self.protection is not None:
            save_theta0(self.protection, checkpoint_dir(args, state))
        if self.cfp is not None and self.cfp.control is not None and state.is_world_process_zero:
            self.cfp.control.save(checkpoint_dir(args, state), self.cfp.protection.lams)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any):
        """Write `cfp_provenance.json` into `args.output_dir` (main process): the anchors, the strength and the
        final drift metrics, beside the model `trainer.save_model()` saves there by default and in what
        `Trainer.push_to_hub` uploads (`trace.write_provenance`). The model's config is not touched."""
        if self.cfp is None:
            return
        metrics = self.cfp.metrics()  # on every process: sums over sharded parameters are all-reduced
        output_dir = getattr(args, "output_dir", None)  # a plain loop may pass no TrainingArguments
        if output_dir and state.is_world_process_zero:
            anchors: list[FisherAnchor] = self.anchors  # type: ignore[assignment]  # bound at train begin
            write_provenance(output_dir, anchors, self.settings.strength.as_trace(), metrics, state.global_step)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        if self.cfp is not None and logs is not None and "loss" in logs:
            add_to_step_log(state, logs, {**self.cfp.metrics(), **self._rechecked})
            self._rechecked = {}


def _optimizer_size(optimizer: torch.optim.Optimizer | None) -> tuple[int, int] | None:
    """(param groups, parameters) of a torch-style optimizer; None when it has no param_groups."""
    groups = getattr(optimizer, "param_groups", None)
    if groups is None:
        return None
    return len(groups), sum(len(g["params"]) for g in groups)
