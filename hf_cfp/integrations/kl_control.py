"""`kl_budget`: lam_t held by a controller on the measured capability KL.

Protecting anchor k has a budget B_k in nats and held-out prompts whose base responses y_n ~ mu_0(.|x_n) are drawn
once, at bind, with their base log-probs (`hf_cfp.evaluation.BaseResponses`). At measured steps, after that step's
correction,

    KL_k = (1/N) sum_n [log mu_0(y_n|x_n) - log mu_theta(y_n|x_n)]        (`hf_cfp.evaluation.kl`).

The same responses are scored every time, so the measured KL moves with theta only, not with fresh sampling noise.
Every process measures the same value without a collective: under DDP the weights are the same; under FSDP or
ZeRO-3 every process takes part in the scoring forward passes. Two rules (`kl_control`):

- "feedforward" (the default), measured every `every` steps and at steps 1, 2, 4, ... before the first. The
  predicted KL Q_k = 0.5 Delta^T F_k Delta (`CFPState.predicted_kls`) is far below the measured one, but their
  ratio rho_k = KL_k / Q_k moves slowly, so the measurements set a target on Q, T_k = B_k / rho_k: where the
  measured KL meets the budget if the ratio stays. The first measurement sets T_k = B_k / rho_k; a later one
  lowers T_k to B_k / rho_k at once, and raises it only to the geometric mean sqrt(T_k B_k / rho_k): a measurement
  under the budget then lowers lam about half as far, which damps the low-high alternation a target set by one low
  measurement started on the embedded run (the ratio grows with lam itself, so a trend of it would carry the
  controller's own moves forward: docs/reports/strength.md). At every step lam_t is the smallest that holds the
  predicted KL of the optimizer's proposal within T (`CFPState.budget_lams`: 0 while under it), and at least a floor
  L_k: the feedback under the feed-forward solve, PPO's adaptive rule below applied to L_k at every `every`-th
  step's measurement, L_k <- L_k (1 + clip(KL_k / B_k - 1, -0.2, 0.2)) from the starting `lam` (while lam_t = 0 the
  run moves along directions F hardly sees, and the ratio jumps: docs/reports/strength.md), L_k at most cap_k.
  lam_t is at most `cap_k` = MAX_PULL / p99(F_k) (p99 of the whole anchor's F, `FisherAnchor.statistics`),
  a pull of MAX_PULL at the 99th percentile of F_k (when the cap binds, a warning says the budget may then not be
  met, and `cfp/<anchor>/lam_capped` is logged as 1). Until the first measurement with KL_k > 0 and Q_k > 0,
  lam_t is the floor.
- "adaptive": PPO's adaptive KL controller (Ziegler et al. 2019), measured every `every` steps,
  lam_k <- lam_k (1 + clip(KL_k / B_k - 1, -0.2, 0.2)), kept between measurements. The feed-forward rule falls back
  to it where the predicted KL has no closed-form solve: LoRA-adapted weights, a sparse plan, several protecting
  anchors on one K-FAC weight.
"""

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from transformers.utils import logging

from ..anchor import FisherAnchor
from ..errors import CFPArgumentError, CFPError
from ..evaluation import BaseResponses, KLEstimate, draw_base_responses
from ..fisher.token_ids import to_token_ids
from ..names import LAM_CAPPED, MEASURED_KL
from ..parallel import log_on_main_process
from ..protection import CFPState

logger = logging.get_logger(__name__)

RULES = ("feedforward", "adaptive")  # the first is the default
MAX_CHANGE = 0.2  # the largest relative change of lam per measurement (PPO's clip)
MAX_PULL = 1e4  # the feed-forward rule's cap: lam_k p99(F_k) <= MAX_PULL
STATE_FILE = "cfp_kl_control.json"  # in a Trainer checkpoint: the base responses, the lams and the targets


def controlled_lams(lams: Sequence[float], kls: Sequence[float], budgets: Sequence[float]) -> list[float]:
    """lam_k * (1 + clip(KL_k / B_k - 1, -MAX_CHANGE, MAX_CHANGE)) for every anchor k."""
    return [
        lam * (1.0 + min(max(kl / budget - 1.0, -MAX_CHANGE), MAX_CHANGE))
        for lam, kl, budget in zip(lams, kls, budgets, strict=True)
    ]


def damped_targets(last: Sequence[float] | None, measured: Sequence[float]) -> list[float]:
    """The feed-forward rule's targets after a measurement: `measured` (B_k / rho_k) at the first, then
    min(B_k / rho_k, sqrt(T_k B_k / rho_k)) for every anchor k."""
    if last is None:
        return list(measured)
    return [min(new, math.sqrt(target * new)) for target, new in zip(last, measured, strict=True)]


@dataclass(frozen=True)
class KLMeasurement:
    """Where and how often `kl_budget` measures each protecting anchor's KL, and its rule: `kl_prompts` (prompts,
    or base responses drawn already, per anchor name), `kl_every` (optimizer steps) and `kl_control`, validated."""

    every: int
    prompts: dict[str, Any]  # anchor name -> prompts or BaseResponses
    rule: str = RULES[0]

    @classmethod
    def of(
        cls,
        *,
        budget: Any,
        prompts: Any,
        every: Any,
        anchor_names: Sequence[str],
        rule: str = RULES[0],
        prefix: str = "",
    ) -> "KLMeasurement | None":
        """The measurement of a `kl_budget` (None without one); messages name the options `prefix` + name.

        Raises:
            CFPArgumentError: kl_prompts without kl_budget or the reverse, kl_every not an integer >= 1, an unknown
                kl_control, or kl_prompts not naming exactly the protecting anchors when there are several.
        """
        if rule not in RULES:
            raise CFPArgumentError(f"{prefix}kl_control must be one of {list(RULES)}, got {rule!r}.")
        if budget is None:
            if prompts is not None:
                raise CFPArgumentError(f"{prefix}kl_prompts is where {prefix}kl_budget is measured: pass both.")
            return None
        if prompts is None:
            raise CFPArgumentError(
                f"{prefix}kl_budget needs {prefix}kl_prompts: held-out prompts of the capability (or "
                "`hf_cfp.evaluation.draw_base_responses` of them), on which the KL to the base is measured."
            )
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise CFPArgumentError(f"{prefix}kl_every must be an integer >= 1 (optimizer steps), got {every!r}.")
        if isinstance(prompts, Mapping):
            if set(prompts) != set(anchor_names):
                raise CFPArgumentError(
                    f"{prefix}kl_prompts names {sorted(prompts)}; the protecting anchors are {list(anchor_names)}."
                )
            return cls(every, dict(prompts), rule)
        if len(anchor_names) > 1:
            raise CFPArgumentError(
                f"With several protecting anchors {list(anchor_names)}, {prefix}kl_prompts maps each anchor name to "
                "its held-out prompts."
            )
        return cls(every, {anchor_names[0]: prompts}, rule)

    def drawn(self, model, tokenizer) -> "KLMeasurement":
        """This measurement with base responses for every anchor: those given as prompts drawn now from `model`
        (the base) with `draw_base_responses` (4 per prompt, up to 64 new tokens, temperature 1, seed 0).

        Raises:
            CFPArgumentError: text prompts without a tokenizer (the loop API has none).
        """
        responses = {}
        for name, source in self.prompts.items():
            if not isinstance(source, BaseResponses):
                source = draw_base_responses(model, tokenizer, self._token_ids(name, source, tokenizer))
            responses[name] = source
        return replace(self, prompts=responses)

    @staticmethod
    def _token_ids(name: str, prompts: Any, tokenizer) -> Any:
        """`prompts` as they are with a tokenizer, else as token ids, with the way out when they are text."""
        if tokenizer is not None:
            return prompts
        try:
            return to_token_ids(prompts, None)
        except CFPArgumentError as error:
            raise CFPArgumentError(
                f"kl_prompts of {name!r}: {error} In the loop API pass base responses drawn with "
                "`hf_cfp.evaluation.draw_base_responses(model, tokenizer, prompts)` (CFPCallback draws them at train "
                "begin with the trainer's tokenizer)."
            ) from error

    def with_saved(self, state: Mapping[str, Any]) -> "KLMeasurement":
        """This measurement on the base responses of a saved `KLControl.state` (the run's original base), for a
        resumed run.

        Raises:
            CFPError: the state is of other anchors.
        """
        saved = state["responses"]
        if sorted(saved) != sorted(self.prompts):
            raise CFPError(
                f"The saved kl_budget state is of the anchors {sorted(saved)}, not {sorted(self.prompts)}: resume "
                "with the anchors the run was started with."
            )
        return replace(self, prompts={name: BaseResponses.from_dict(saved[name]) for name in self.prompts})


@dataclass
class KLControl:
    """The controller of the module docstring for the protecting anchors `names`, in order: its rule, its state
    (`held`, the lams between measurements, or the feed-forward rule's floors L_k; `targets`, its T_k) and the
    feed-forward rule's caps."""

    names: tuple[str, ...]
    budgets: tuple[float, ...]
    every: int
    responses: tuple[BaseResponses, ...]
    rule: str
    held: list[float]
    caps: tuple[float, ...] = ()
    targets: list[float] | None = None
    capped: list[bool] = field(default_factory=list)  # per anchor, whether the last step's lam was held at its cap
    _warned: set[str] = field(default_factory=set)

    @classmethod
    def of(
        cls,
        measurement: KLMeasurement,
        protection: CFPState,
        budgets: Sequence[float],
        start: Sequence[float],
        anchors: Sequence[FisherAnchor],
    ) -> "KLControl":
        """The controller of a measurement whose responses are drawn (`KLMeasurement.drawn`), from lams `start`, for
        the protecting `anchors` (their F's 99th percentile sets the caps)."""
        names = protection.protecting
        rule = measurement.rule
        if rule == "feedforward" and not protection.solves_budget:
            log_on_main_process(
                logger.warning,
                "CFP kl_budget: the predicted KL has no closed-form solve here (LoRA-adapted weights, a sparse plan, "
                "or several protecting anchors on one K-FAC weight); kl_control='adaptive' holds the budget instead.",
            )
            rule = "adaptive"
        caps = tuple(_cap(anchor) for anchor in anchors) if rule == "feedforward" else ()
        responses = tuple(measurement.prompts[name] for name in names)
        return cls(tuple(names), tuple(budgets), measurement.every, responses, rule, list(start), caps)

    def due(self, step: int) -> bool:
        """Whether `step` is measured: every `every` steps, and at 1, 2, 4, ... before the first (feed-forward)."""
        early = self.rule == "feedforward" and step < self.every and step & (step - 1) == 0
        return step % self.every == 0 or early

    def lams(self, protection: CFPState) -> list[float]:
        """lam_t for the step whose proposal `protection` holds now (module docstring)."""
        if self.targets is None:
            return list(self.held)
        wanted = [max(lam, floor) for lam, floor in zip(protection.budget_lams(self.targets), self.held, strict=True)]
        self.capped = [lam >= cap for lam, cap in zip(wanted, self.caps, strict=True)]  # the floor stops at its cap
        for name, lam, cap, budget in zip(self.names, wanted, self.caps, self.budgets, strict=True):
            if lam >= cap and name not in self._warned:
                self._warned.add(name)
                log_on_main_process(
                    logger.warning,
                    "CFP kl_budget: holding %s's measured KL at %g nats needs lam_t %.3g, above its cap %.3g (a pull "
                    "of %g at the 99th percentile of its F): the KL comes from directions its F hardly sees, and the "
                    "budget may not be met. Raise the budget, or estimate the anchor on more prompts (a K-FAC "
                    "anchor sees more of them).",
                    name,
                    budget,
                    lam,
                    cap,
                    MAX_PULL,
                )
        return [min(lam, cap) for lam, cap in zip(wanted, self.caps, strict=True)]

    def update(self, model, protection: CFPState, lams: Sequence[float], step: int) -> list[KLEstimate]:
        """Measure the KL of each anchor on `model` now (after the correction with `lams`) and update the rule's
        state (the adaptive rule's new lams also in `protection.lams`); returns the measurements."""
        estimates = [responses.kl(model) for responses in self.responses]
        kls = [e.kl for e in estimates]
        if self.rule == "adaptive":  # the lams of the steps that follow, logged from now
            self.held = protection.lams = controlled_lams(lams, kls, self.budgets)
            return estimates
        if step % self.every == 0:  # the floors' feedback, at the adaptive rule's measurements only, up to the caps
            floors = controlled_lams(self.held, kls, self.budgets)
            self.held = [min(floor, cap) for floor, cap in zip(floors, self.caps, strict=True)]
        predicted = protection.predicted_kls()
        if all(kl > 0 and q > 0 for kl, q in zip(kls, predicted, strict=True)):
            self.targets = damped_targets(
                self.targets, [b * q / kl for b, kl, q in zip(self.budgets, kls, predicted, strict=True)]
            )
        return estimates

    def metrics(self, estimates: Sequence[KLEstimate]) -> dict[str, float]:
        """{`cfp/<anchor>/measured_kl`: KL} of the last measurement, and under the feed-forward rule
        {`cfp/<anchor>/lam_capped`: 1 or 0} of the last step."""
        metrics = {MEASURED_KL.key(name): e.kl for name, e in zip(self.names, estimates, strict=True)}
        if self.rule == "feedforward":
            capped = self.capped or [False] * len(self.names)
            metrics.update({LAM_CAPPED.key(name): float(c) for name, c in zip(self.names, capped, strict=True)})
        return metrics

    def state(self, lams: Sequence[float]) -> dict[str, Any]:
        """What a resumed run needs: the last lams (`lams`), the rule's state and every anchor's base responses
        (`BaseResponses.to_dict`)."""
        return {
            "lams": list(lams),
            "held": list(self.held),
            "targets": self.targets,
            "responses": {n: r.to_dict() for n, r in zip(self.names, self.responses, strict=True)},
        }

    def restore(self, state: Mapping[str, Any]) -> list[float]:
        """Continue from a saved `state`; returns its last lams (the protection's)."""
        self.held = [float(lam) for lam in state.get("held", state["lams"])]
        targets = state.get("targets")
        self.targets = [float(t) for t in targets] if targets is not None else None
        return [float(lam) for lam in state["lams"]]

    def save(self, directory: str | Path, lams: Sequence[float]) -> None:
        """Write `state(lams)` to `directory`/cfp_kl_control.json."""
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / STATE_FILE).write_text(json.dumps(self.state(lams)))


def _cap(anchor: FisherAnchor) -> float:
    """MAX_PULL / p99(F) of the anchor (its statistics, the same on every process; inf for p99 = 0)."""
    p99 = float((anchor.metadata.get("statistics") or anchor.statistics())["p99"])
    return MAX_PULL / p99 if p99 > 0 else math.inf


def saved_state(directory: str | Path | None) -> dict[str, Any] | None:
    """The `KLControl.state` saved in a checkpoint directory, or None."""
    path = Path(directory) / STATE_FILE if directory is not None else None
    return json.loads(path.read_text()) if path is not None and path.is_file() else None
