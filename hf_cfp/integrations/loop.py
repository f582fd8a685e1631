"""CFP for a custom training loop (an accelerate loop, PPO-style RL without a Trainer): the same protection as
`CFPCallback`, driven by two calls."""

import os
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from ..anchor import FisherAnchor
from ..evaluation import KLEstimate
from ..protection import Theta0Pieces
from ..protection.theta0 import Theta0Reader
from .kl_control import KLControl
from .options import LOOP, ProtectionOptions
from .resolve import AnchorLike, load_anchor
from .settings import ProtectionSettings
from .strength import LamSchedule, first_lr
from .surfaces import documents_options, option_entries


@documents_options(option_entries(LOOP))
class CFP:
    r"""
    Cumulative Fisher Protection in a loop you write: bind at construction (theta0 = the model's weights now, or
    `theta0`'s), call [`~CFP.step`] after every `optimizer.step()` and [`~CFP.metrics`] when you log.

    $$\theta_{t+1} = \theta_0 + \frac{\theta' - \theta_0}{1 + \sum_k \lambda_{k,t} F_k}$$

    Args:
        model (`torch.nn.Module`):
            The model being trained (plain, PEFT, or prepared by accelerate).

    Example:

    ```python
    protector = CFP(model, "anchors/math", lam=300.0, optimizer=optimizer)
    for step, batch in enumerate(loader, 1):
        accelerator.backward(model(**batch).loss)
        optimizer.step()
        optimizer.zero_grad()
        protector.step()
        if step % 10 == 0:
            accelerator.log(protector.metrics(), step=step)
    ```
    """

    def __init__(  # the model, then the options CFP takes, as declared (`options.signature_of(LOOP)`; tested)
        self,
        model: torch.nn.Module,
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
        optimizer: torch.optim.Optimizer | None = None,
        theta0: Theta0Reader | None = None,
    ) -> None:
        options = ProtectionOptions.of_call(LOOP, locals())
        anchors = [load_anchor(a) for a in anchor_list(options.anchor)]
        monitors = [load_anchor(m) for m in options.monitor]
        settings = ProtectionSettings.of(options, [a.name for a in anchors], monitors)
        self._bind(model, anchors, settings, options.optimizer, options.theta0)

    def _bind(self, model, anchors, settings: ProtectionSettings, optimizer, theta0) -> None:
        measurement = settings.kl_measurement
        if measurement is not None:  # kl_budget's base responses, drawn once from the model now (theta0)
            settings = replace(settings, kl_measurement=measurement.drawn(model, None))
        self.anchors, self.settings, self.optimizer = list(anchors), settings, optimizer
        self.protection = settings.bind(model, self.anchors, optimizer, theta0)
        self.steps = 0  # optimizer steps corrected
        self.control = self._control(settings)
        self.measured: list[KLEstimate] = []  # the controller's last measurement

    def _control(self, settings: ProtectionSettings) -> KLControl | None:
        """kl_budget's controller (None without one), with the protection's lams at its start."""
        budget, measurement = settings.strength.kl_budget, settings.kl_measurement
        if budget is None or measurement is None:
            return None
        self.protection.lams = list(settings.strength.start)
        return KLControl.of(measurement, self.protection, budget, settings.strength.start, self.anchors)

    def step(self, step: int | None = None, lr: float | None = None, measure_residual: bool = False) -> list[float]:
        """Correct the weights after an optimizer step: theta <- theta0 + (theta - theta0) / (1 + sum_k lam_k,t F_k)
        with lam_t from `lam`, from the `kl_budget` controller (`kl_control`), or solved for `predicted_kl_budget` at
        this step; under `kl_budget`, at measured steps the KL is then measured and the controller updated.

        Args:
            step (`int`, *optional*): the optimizer step just taken (1-based); defaults to counting the calls.
            lr (`float`, *optional*): its learning rate (for `scale_lam_with_lr`); defaults to the optimizer's
                first param group's.
            measure_residual (`bool`, *optional*): on LoRA-adapted weights, measure the share of the target the
                adapter missed, reported by the next `metrics()` as `cfp/<anchor>/adapter_residual`.

        Returns:
            `list[float]`: the lam_t of each protecting anchor.
        """
        self.steps = self.steps + 1 if step is None else step
        learning_rate = lr if lr is not None else first_lr(self.optimizer)
        if self.control is not None:
            lams = self.control.lams(self.protection)
        else:
            lams = self.settings.strength.lams(self.steps, learning_rate, self.protection)
        self.protection.correct(lams, measure_residual=measure_residual)
        if self.control is not None and self.control.due(self.steps):
            self.measured = self.control.update(self.protection.model, self.protection, lams, self.steps)
        return lams

    def metrics(self) -> dict[str, float]:
        """The `cfp/*` drift metrics now (the same keys and values `CFPCallback` logs); with sharded parameters
        every process must call it (one collective).

        Returns:
            `dict[str, float]`: metric key -> value, the same on every process (`hf_cfp.names.LOGGED_METRICS`).
        """
        measured = self.control.metrics(self.measured) if self.control is not None and self.measured else {}
        return {**self.protection.drift_metrics(), **measured}

    def refresh(self, anchors: Sequence[FisherAnchor]) -> None:
        """Correct and measure with `anchors` (re-estimated F) from now on, keeping theta0, the LoRA factors at
        train begin and lam_t's warm start."""
        lams = self.protection.lams
        self.protection = self.settings.bind(
            self.protection.model, anchors, self.optimizer, self.protection.theta0_pieces()
        )
        self.anchors, self.protection.lams = list(anchors), lams

    def state_dict(self) -> dict[str, Any]:
        """What a resumed loop needs: the steps taken, the last lams, this process's theta0 pieces (in the
        parameters' dtype) and, on a PEFT model, the LoRA factors at train begin, all on the CPU. Save it with
        your checkpoint, per process.

        Returns:
            `dict[str, Any]`: `{"steps": int, "lams": list[float], "theta0": {name: tensor}, "lora0": {weight name:
            [(s0, B0, A0) per active adapter]}}`, and with `kl_budget` `"kl_control"`: the base responses it
            measures on.
        """
        pieces = self.protection.theta0_pieces()
        theta0 = {name: t.detach().cpu().clone() for name, t in pieces.theta0.items()}
        lora0 = {
            name: [(s0, b0.detach().cpu().clone(), a0.detach().cpu().clone()) for s0, b0, a0 in snapshot]
            for name, snapshot in (pieces.snapshots or {}).items()
        }
        state = {"steps": self.steps, "lams": list(self.protection.lams), "theta0": theta0, "lora0": lora0}
        if self.control is not None:  # the base responses of kl_budget, so that a resumed loop measures the same KL
            state["kl_control"] = self.control.state(self.protection.lams)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the path of `state` (from `state_dict`): rebind with its theta0 (and LoRA factors) and step
        count.

        Args:
            state (`dict[str, Any]`): what `state_dict` returned on this process.

        Raises:
            CFPError: `state` holds no theta0 for a parameter the anchors cover on this model, or no LoRA factors
                for an adapted weight.
        """
        saved = Theta0Pieces(state["theta0"], state.get("lora0"), "the CFP state_dict")
        settings, measurement = self.settings, self.settings.kl_measurement
        if measurement is not None:  # measure on the run's original base responses
            settings = replace(settings, kl_measurement=measurement.with_saved(state["kl_control"]))
        self._bind(self.protection.model, self.anchors, settings, self.optimizer, saved)
        self.protection.lams = list(state["lams"])
        if self.control is not None:
            self.protection.lams = self.control.restore(state["kl_control"])
        self.steps = int(state["steps"])


def anchor_list(anchor: AnchorLike | Sequence[AnchorLike]) -> list[AnchorLike]:
    """One anchor (an anchor, a directory, a Hub reference) or a sequence of them, as a list."""
    return [anchor] if isinstance(anchor, (str, os.PathLike, FisherAnchor)) else list(anchor)
