"""How hard CFP pulls at each step: lam_t per protecting anchor from a constant, a schedule, the learning rate,
a measured KL budget or a predicted one; and the one line at train begin that says what that strength does."""

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import CFPArgumentError
from ..protection import CFPState, describe_sparse

LamSchedule = Callable[[int], float | Sequence[float]]


@dataclass(frozen=True)
class Strength:
    """lam_t for the protecting anchors, one of four ways:

    - `lam`: a number or one per anchor, or a schedule `step -> lam(s)` (the optimizer step just taken, 1-based);
      with `scale_with_lr`, each is multiplied by the step's learning rate eta_t: the proximal form
      theta0 + Delta / (1 + eta_t lam F), so the pull follows warmup and decay and the fixed point of a persistent
      step eta_t u is u / (lam F), whatever the learning rate;
    - `kl_budget`: nats, a number or one per anchor; lam_t starts at `lam` and is then set by the controller on the
      measured KL (`kl_control.KLControl`);
    - `predicted_kl_budget`: nats, a number or one per anchor; lam_t solved at each step so that the predicted KL
      0.5 Delta^T F Delta stays within it and no harder (`CFPState.budget_lams`).
    """

    lam: tuple[float, ...] | LamSchedule  # () with a predicted budget; the controller's start with kl_budget
    kl_budget: tuple[float, ...] | None
    predicted_kl_budget: tuple[float, ...] | None
    scale_with_lr: bool
    num_anchors: int

    @property
    def start(self) -> tuple[float, ...]:
        """The constant lams, or with `kl_budget` the controller's starting ones."""
        if callable(self.lam):
            raise CFPArgumentError("lam is a schedule here, not a constant.")
        return self.lam

    @classmethod
    def from_arguments(
        cls,
        *,
        lam: Any,
        kl_budget: Any,
        predicted_kl_budget: Any,
        scale_with_lr: bool,
        num_anchors: int,
        prefix: str = "",
    ) -> "Strength":
        """The strength of `lam`, `kl_budget` or `predicted_kl_budget` for `num_anchors` protecting anchors; messages
        name the options `prefix` + name (`settings.ProtectionSettings.of`)."""
        if kl_budget is not None:
            return cls._controlled(lam, kl_budget, predicted_kl_budget, scale_with_lr, num_anchors, prefix)
        if lam is not None and predicted_kl_budget is not None:
            raise CFPArgumentError(
                f"Pass {prefix}lam or {prefix}predicted_kl_budget, not both: predicted_kl_budget chooses lam_t at "
                "every step to keep the predicted KL within the budget."
            )
        if predicted_kl_budget is not None:
            if scale_with_lr:
                raise CFPArgumentError(
                    f"{prefix}scale_lam_with_lr applies to {prefix}lam; {prefix}predicted_kl_budget already sets "
                    "lam_t every step."
                )
            budget = _per_anchor(predicted_kl_budget, num_anchors, f"{prefix}predicted_kl_budget", positive=True)
            return cls((), None, budget, False, num_anchors)
        if lam is None:
            lam = 1.0
        fixed = lam if callable(lam) else _per_anchor(lam, num_anchors, f"{prefix}lam", positive=False)
        return cls(fixed, None, None, scale_with_lr, num_anchors)

    @classmethod
    def _controlled(
        cls, lam: Any, kl_budget: Any, predicted: Any, scale_with_lr: bool, num_anchors: int, prefix: str
    ) -> "Strength":
        """`kl_budget` with the controller's starting `lam` (default 1.0), each > 0: lam_t is then multiplied at
        every measurement, so it needs a start it can grow from."""
        if predicted is not None or scale_with_lr or callable(lam):
            raise CFPArgumentError(
                f"{prefix}kl_budget sets lam_t from the measured KL, starting at {prefix}lam: pass it without "
                f"{prefix}predicted_kl_budget, {prefix}scale_lam_with_lr or a lam schedule."
            )
        start = _per_anchor(1.0 if lam is None else lam, num_anchors, f"{prefix}lam", positive=True)
        budget = _per_anchor(kl_budget, num_anchors, f"{prefix}kl_budget", positive=True)
        return cls(start, budget, None, False, num_anchors)

    def lams(self, step: int, learning_rate: float | None, protection: CFPState) -> list[float]:
        """lam_t of each protecting anchor for the optimizer step `step` just taken (at `learning_rate`); under
        `kl_budget` the controller's (`kl_control.KLControl.lams`) instead."""
        if self.predicted_kl_budget is not None:
            return protection.budget_lams(self.predicted_kl_budget)
        # a schedule's value is checked at each step; a constant was checked once, in from_arguments
        lams = list(_per_anchor(self.lam(step), self.num_anchors, "lam", False) if callable(self.lam) else self.lam)
        if self.scale_with_lr:
            if learning_rate is None:
                raise CFPArgumentError(
                    "scale_lam_with_lr=True needs the optimizer's learning rate, and none was passed to the callback."
                )
            lams = [lam * learning_rate for lam in lams]
        return lams

    def describe(self, protection: CFPState, learning_rate: float | None) -> str:
        """What the strength does, in one line: for a budget, its value; for lam, the share of covered
        coordinates with P = sum_k lam_k F_k > 1 (pulled back by more than half each step) and, given the
        learning rate, the fixed-point displacement d / P of a persistent step d = learning_rate (an Adam-sized
        step) at the 99th and 99.9th percentiles of P (P at the peak learning rate when lam follows it)."""
        anchors = ", ".join(protection.protecting)
        if self.kl_budget is not None:
            return (
                f"CFP [{anchors}]: kl_budget {_numbers(self.kl_budget)} nats of measured KL on kl_prompts; lam_t "
                f"starts at {_numbers(self.start)}, then the kl_control rule sets it from the measurements."
            )
        if self.predicted_kl_budget is not None:
            return (
                f"CFP [{anchors}]: predicted_kl_budget {_numbers(self.predicted_kl_budget)} nats; lam_t is solved "
                "at every step so that the predicted KL 0.5 Delta^T F Delta stays within it (lam_t = 0 while inside)."
            )
        if callable(self.lam):
            return f"CFP [{anchors}]: lam follows a schedule of the step; its pull changes with it."
        if self.scale_with_lr and learning_rate is None:
            return f"CFP [{anchors}]: lam {_numbers(self.lam)} x the learning rate of each step."
        lams = [lam * learning_rate for lam in self.lam] if self.scale_with_lr and learning_rate else list(self.lam)
        count, halved, p99, p999 = protection.pull_profile(lams)
        scaled = f" x lr ({learning_rate:g} at peak)" if self.scale_with_lr else ""
        line = (
            f"CFP [{anchors}]: lam {_numbers(self.lam)}{scaled} pulls {halved:.2%} of {count:,} protected "
            "coordinates back by more than half each step (sum lam F > 1)"
        )
        if learning_rate is None:
            return line + "."
        return (
            f"{line}; a persistent step of {learning_rate:g} settles at |theta - theta0| = "
            f"{_settle(learning_rate, p99)} at the 99th percentile of lam F, {_settle(learning_rate, p999)} at the "
            "99.9th."
        )

    def as_trace(self) -> dict[str, Any]:
        """The strength as recorded beside a trained model: {"lam": [...] or "schedule", "scale_lam_with_lr"}
        or {"predicted_kl_budget": [...]} (`trace.write_provenance`)."""
        if self.kl_budget is not None:
            return {"kl_budget": list(self.kl_budget), "lam": list(self.start)}
        if self.predicted_kl_budget is not None:
            return {"predicted_kl_budget": list(self.predicted_kl_budget)}
        return {"lam": "schedule" if callable(self.lam) else list(self.lam), "scale_lam_with_lr": self.scale_with_lr}

    def describe_sparse(self, protection: CFPState) -> str:
        """The sparse plan's line (`geometry.diagonal.sparse.describe_sparse`), with the largest lam F dropped when
        lam is a constant."""
        assert protection.sparse_report is not None  # a sparse plan
        constant = None if callable(self.lam) or self.scale_with_lr else self.lam
        return describe_sparse(protection.sparse_report, protection.protecting, constant)


def first_lr(optimizer: Any) -> float | None:
    """The first param group's learning rate (None without a torch-style optimizer)."""
    groups = getattr(optimizer, "param_groups", None)
    return float(groups[0]["lr"]) if groups else None


def _settle(step: float, pull: float) -> str:
    """The fixed point d / P of a persistent step d under the pull P."""
    return f"{step / pull:.3g}" if pull > 0 else "no limit (no pull)"


def _numbers(values: Sequence[float]) -> str:
    return ", ".join(f"{v:g}" for v in values)


def _per_anchor(value: Any, num_anchors: int, what: str, positive: bool) -> tuple[float, ...]:
    """`value` (a number, or a sequence of one per anchor) as a tuple, each finite and >= 0 (> 0 if `positive`)."""
    values = [value] * num_anchors if _is_number(value) else list(value) if isinstance(value, Sequence) else None
    if values is None or len(values) != num_anchors or not all(_is_number(v) for v in values):
        raise CFPArgumentError(
            f"{what} must be a number or a sequence of {num_anchors} numbers (one per protecting anchor), "
            f"got {value!r}."
        )
    bound = "> 0" if positive else ">= 0"
    if not all(math.isfinite(v) and (v > 0 if positive else v >= 0) for v in values):
        raise CFPArgumentError(f"{what} must be finite and {bound} (or a schedule returning such), got {value!r}.")
    return tuple(float(v) for v in values)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_lam(lam: Any) -> float:
    """One lam, finite and >= 0, or CFPArgumentError."""
    return _per_anchor(lam, 1, "lam", positive=False)[0]
