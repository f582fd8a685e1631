"""`kl_budget`: lam_t held by a controller on the measured capability KL, as PPO's adaptive KL controller holds its
KL coefficient (Ziegler et al. 2019).

Protecting anchor k has a budget B_k in nats and held-out prompts whose base responses y_n ~ mu_0(.|x_n) are drawn
once, at bind, with their base log-probs (`hf_cfp.evaluation.BaseResponses`). Every `every` optimizer steps, after
that step's correction,

    KL_k = (1/N) sum_n [log mu_0(y_n|x_n) - log mu_theta(y_n|x_n)]        (`hf_cfp.evaluation.kl`)
    lam_k <- lam_k * (1 + clip(KL_k / B_k - 1, -0.2, 0.2)),

so lam_k grows by at most 20% per measurement while the capability is over its budget and shrinks by at most 20%
while it is under. Between measurements lam_k stays. The same responses are scored every time, so the measured KL
moves with theta only, not with fresh sampling noise. Every process measures the same value without a collective:
under DDP the weights are the same; under FSDP or ZeRO-3 every process takes part in the scoring forward passes.
"""

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CFPArgumentError, CFPError
from ..evaluation import BaseResponses, KLEstimate, draw_base_responses
from ..fisher.token_ids import to_token_ids
from ..names import MEASURED_KL

MAX_CHANGE = 0.2  # the largest relative change of lam per measurement (PPO's clip)
STATE_FILE = "cfp_kl_control.json"  # in a Trainer checkpoint: the base responses and the lams


def controlled_lams(lams: Sequence[float], kls: Sequence[float], budgets: Sequence[float]) -> list[float]:
    """lam_k * (1 + clip(KL_k / B_k - 1, -MAX_CHANGE, MAX_CHANGE)) for every anchor k."""
    return [
        lam * (1.0 + min(max(kl / budget - 1.0, -MAX_CHANGE), MAX_CHANGE))
        for lam, kl, budget in zip(lams, kls, budgets, strict=True)
    ]


@dataclass(frozen=True)
class KLMeasurement:
    """Where and how often `kl_budget` measures each protecting anchor's KL: `kl_prompts` (prompts, or base
    responses drawn already, per anchor name) and `kl_every` (optimizer steps), validated."""

    every: int
    prompts: dict[str, Any]  # anchor name -> prompts or BaseResponses

    @classmethod
    def of(
        cls, *, budget: Any, prompts: Any, every: Any, anchor_names: Sequence[str], prefix: str = ""
    ) -> "KLMeasurement | None":
        """The measurement of a `kl_budget` (None without one); messages name the options `prefix` + name.

        Raises:
            CFPArgumentError: kl_prompts without kl_budget or the reverse, kl_every not an integer >= 1, or
                kl_prompts not naming exactly the protecting anchors when there are several.
        """
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
            return cls(every, dict(prompts))
        if len(anchor_names) > 1:
            raise CFPArgumentError(
                f"With several protecting anchors {list(anchor_names)}, {prefix}kl_prompts maps each anchor name to "
                "its held-out prompts."
            )
        return cls(every, {anchor_names[0]: prompts})

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
        return KLMeasurement(self.every, responses)

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
        return KLMeasurement(self.every, {name: BaseResponses.from_dict(saved[name]) for name in self.prompts})


@dataclass(frozen=True)
class KLControl:
    """The controller of the module docstring for the protecting anchors `names`, in order."""

    names: tuple[str, ...]
    budgets: tuple[float, ...]
    every: int
    responses: tuple[BaseResponses, ...]

    @classmethod
    def of(cls, measurement: KLMeasurement, names: Sequence[str], budgets: Sequence[float]) -> "KLControl":
        """The controller of a measurement whose responses are drawn (`KLMeasurement.drawn`)."""
        responses = [measurement.prompts[name] for name in names]
        return cls(tuple(names), tuple(budgets), measurement.every, tuple(responses))

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def update(self, model, lams: Sequence[float]) -> tuple[list[float], list[KLEstimate]]:
        """(the next lams, the KL of each anchor measured on `model` now)."""
        estimates = [responses.kl(model) for responses in self.responses]
        return controlled_lams(lams, [e.kl for e in estimates], self.budgets), estimates

    def metrics(self, estimates: Sequence[KLEstimate]) -> dict[str, float]:
        """{`cfp/<anchor>/measured_kl`: KL} of the last measurement."""
        return {MEASURED_KL.key(name): e.kl for name, e in zip(self.names, estimates, strict=True)}

    def state(self, lams: Sequence[float]) -> dict[str, Any]:
        """What a resumed run needs: the lams and every anchor's base responses (`BaseResponses.to_dict`)."""
        return {
            "lams": list(lams),
            "responses": {n: r.to_dict() for n, r in zip(self.names, self.responses, strict=True)},
        }

    def save(self, directory: str | Path, lams: Sequence[float]) -> None:
        """Write `state(lams)` to `directory`/cfp_kl_control.json."""
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / STATE_FILE).write_text(json.dumps(self.state(lams)))


def saved_state(directory: str | Path | None) -> dict[str, Any] | None:
    """The `KLControl.state` saved in a checkpoint directory, or None."""
    path = Path(directory) / STATE_FILE if directory is not None else None
    return json.loads(path.read_text()) if path is not None and path.is_file() else None
