"""CFP for a custom training loop (an accelerate loop, PPO-style RL without a Trainer): the same protection as
`CFPCallback`, driven by two calls."""

import os
from collections.abc import Sequence
from typing import Any

import torch

from ..anchor import FisherAnchor
from ..errors import CFPError
from ..protection import CFPState, MemoryPlan, Theta0Pieces
from .resolve import AnchorLike, load_anchor
from .strength import LamSchedule, Strength, first_lr


class CFP:
    r"""
    Cumulative Fisher Protection in a loop you write: bind at construction (theta0 = the model's weights now), call
    [`~CFP.step`] after every `optimizer.step()` and [`~CFP.metrics`] when you log.

    $$\theta_{t+1} = \theta_0 + \frac{\theta' - \theta_0}{1 + \sum_k \lambda_{k,t} F_k}$$

    Args:
        model: the model being trained (plain, PEFT, or prepared by accelerate).
        anchor ([`FisherAnchor`], a directory or a Hub reference, or a sequence of them): the protecting anchor(s).
        lam, kl_budget, scale_lam_with_lr, monitor, free_fraction, lora_rule, fisher_dtype, sparse, sparse_by:
            as in [`CFPCallback`].
        optimizer (`torch.optim.Optimizer`, *optional*): the loop's optimizer; needed for `scale_lam_with_lr` (its
            learning rate) and under DeepSpeed ZeRO (its fp32 master weights).

    Raises:
        CFPArgumentError: a bad strength (negative or non-finite lam or budget, both, or the wrong count) or memory
            plan (fisher_dtype, sparse, sparse_by).
        AnchorNotFoundError, AnchorMismatchError: an anchor that cannot be loaded, or that does not fit `model`.

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

    def __init__(
        self,
        model: torch.nn.Module,
        anchor: AnchorLike | Sequence[AnchorLike],
        lam: float | Sequence[float] | LamSchedule | None = None,
        kl_budget: float | Sequence[float] | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        monitor: Sequence[AnchorLike] = (),
        free_fraction: float = 0.99,
        scale_lam_with_lr: bool = False,
        lora_rule: str = "proximal_b",
        fisher_dtype: str = "float32",
        sparse: float | None = None,
        sparse_by: str = "coordinates",
    ):
        given = [anchor] if isinstance(anchor, (str, os.PathLike, FisherAnchor)) else list(anchor)
        self.anchors = [load_anchor(a) for a in given]
        self.monitors = [load_anchor(m) for m in monitor]
        self.strength = Strength.from_arguments(lam, kl_budget, scale_lam_with_lr, len(self.anchors))
        self.optimizer = optimizer
        self.free_fraction, self.lora_rule = free_fraction, lora_rule
        self.memory = MemoryPlan(fisher_dtype, sparse, sparse_by)
        self.protection = self._bind(model, None)
        self.steps = 0  # optimizer steps corrected

    def _bind(self, model: torch.nn.Module, theta0: Any) -> CFPState:
        return CFPState(
            model, self.anchors, self.monitors, self.free_fraction, self.optimizer, theta0, self.lora_rule, self.memory
        )

    def step(self) -> list[float]:
        """Correct the weights after an optimizer step: theta <- theta0 + (theta - theta0) / (1 + sum_k lam_k,t F_k)
        with lam_t from `lam` (or solved for `kl_budget`) at this step (1-based count of calls).

        Returns:
            `list[float]`: the lam_t of each protecting anchor.
        """
        self.steps += 1
        lams = self.strength.lams(self.steps, first_lr(self.optimizer), self.protection)
        self.protection.correct(lams)
        return lams

    def metrics(self) -> dict[str, float]:
        """The `cfp/*` drift metrics now (the same keys and values `CFPCallback` logs); with sharded parameters
        every process must call it (one collective).

        Returns:
            `dict[str, float]`: metric key -> value, the same on every process (`hf_cfp.names.LOGGED_METRICS`).
        """
        return self.protection.drift_metrics()

    def state_dict(self) -> dict[str, Any]:
        """What a resumed loop needs: the steps taken, the last lams and this process's theta0 pieces (in the
        parameters' dtype, on the CPU). Save it with your checkpoint, per process.

        Returns:
            `dict[str, Any]`: `{"steps": int, "lams": list[float], "theta0": {name: tensor}}`.

        Raises:
            CFPError: the model has LoRA-adapted weights (their resume is not covered yet; use `CFPCallback`).
        """
        if self.protection.adapted:
            raise CFPError("CFP.state_dict does not cover LoRA-adapted weights yet: use CFPCallback to resume them.")
        theta0 = {
            n: t.detach().cpu().clone() for n, t in zip(self.protection.names, self.protection.theta0, strict=True)
        }
        return {"steps": self.steps, "lams": list(self.protection.lams), "theta0": theta0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the path of `state` (from `state_dict`): rebind with its theta0 and step count.

        Args:
            state (`dict[str, Any]`): what `state_dict` returned on this process.

        Raises:
            CFPError: `state` holds no theta0 for a parameter the anchors cover on this model.
        """
        self.protection = self._bind(self.protection.model, Theta0Pieces(state["theta0"], None, "the CFP state_dict"))
        self.protection.lams = list(state["lams"])
        self.steps = int(state["steps"])
