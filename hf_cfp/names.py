"""Canonical names: parameter names as `model.named_parameters()` gives them once wrappers are removed, and
the keys of the metrics hf-cfp logs (`LOGGED_METRICS`, rendered as the README's table by `metrics_table`).

Reporters prefix the keys: TensorBoard shows `cfp/math/sensitive_drift` as `train/cfp/math/sensitive_drift`.
"""

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from .errors import CFPArgumentError

# Prefixes added by wrappers: DDP/DataParallel (`module.`), torch.compile (`_orig_mod.`),
# FSDP (`_fsdp_wrapped_module.`) and activation checkpointing (`_checkpoint_wrapped_module.`).
_WRAPPER_PARTS = ("module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")
_WRAPPER_PREFIX = re.compile(r"^(?:(?:" + "|".join(_WRAPPER_PARTS) + r")\.)+")
_INNER_WRAPPER = re.compile(r"\.(?:_orig_mod|_fsdp_wrapped_module|_checkpoint_wrapped_module)(?=\.)")


def canonical_name(name: str) -> str:
    """Strip wrapper prefixes: `module._orig_mod.model.layers.0.mlp` -> `model.layers.0.mlp`."""
    return _INNER_WRAPPER.sub("", _WRAPPER_PREFIX.sub("", name))


def named_parameters_once(model: torch.nn.Module, *, trainable_only: bool) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """`(canonical_name, parameter)` pairs, every parameter once: a tied parameter appears under its
    first name only. `trainable_only=True` skips parameters with `requires_grad=False`."""
    seen = set()
    for name, param in model.named_parameters():
        if id(param) in seen or (trainable_only and not param.requires_grad):
            continue
        seen.add(id(param))
        yield canonical_name(name), param


# ---------------------------------------------------------------- logged metric keys

_PLACEHOLDER = re.compile(r"<(?:anchor|name)>")


@dataclass(frozen=True)
class LoggedMetric:
    """One metric hf-cfp logs. The one place metric keys are spelled: the code builds keys with `key`, the README's
    table is `metrics_table()`.

    Args:
        pattern (`str`): the key, `<anchor>` or `<name>` standing for a name (`cfp/<anchor>/sensitive_drift`).
        meaning (`str`): what the value is (markdown, no `|`).
        logged (`str`): when it is logged (markdown, no `|`).
    """

    pattern: str
    meaning: str
    logged: str

    def key(self, name: str | None = None) -> str:
        """The key of this metric for the anchor (or `KLToBaseCallback` name) `name`.

        Args:
            name (`str`, *optional*):
                The name that replaces `<anchor>` / `<name>`; only for patterns that have one.

        Returns:
            `str`: the key, e.g. `cfp/math/sensitive_drift`.

        Raises:
            CFPArgumentError: `name` is missing for a pattern with a placeholder, or given for one without.
        """
        if bool(_PLACEHOLDER.search(self.pattern)) != (name is not None):
            needs = "needs a name" if name is None else f"takes no name (got {name!r})"
            raise CFPArgumentError(f"The metric key {self.pattern!r} {needs}.")
        return self.pattern if name is None else _PLACEHOLDER.sub(name, self.pattern)


_EVERY_ANCHOR = "every logging step, per protecting and monitor anchor"
SENSITIVE_DRIFT = LoggedMetric(
    "cfp/<anchor>/sensitive_drift",
    "`sqrt(sum_i F_i Delta_i^2)`; a K-FAC anchor's factored weights add `vec(Delta_W)^T (G_r (x) A_r) "
    "vec(Delta_W)`, summed over the eigen-directions of `A_r (x) G_r` (kept and tail blocks)",
    _EVERY_ANCHOR,
)
PREDICTED_KL = LoggedMetric(
    "cfp/<anchor>/predicted_kl",
    "`0.5 sensitive_drift^2`, the second-order KL to the base on the anchor's prompts under the anchor's "
    '(diagonal or K-FAC) Fisher, nats (see "Choosing the strength" for how well it predicts)',
    _EVERY_ANCHOR,
)
FREE_DRIFT = LoggedMetric(
    "cfp/<anchor>/free_drift",
    "`norm(Delta)` over the `free_fraction` of coordinates with the smallest `F` (threshold fixed once at bind; "
    "the coordinates of `A_r (x) G_r`'s eigenbasis for a K-FAC anchor's factored weights)",
    _EVERY_ANCHOR,
)
TOTAL_DRIFT = LoggedMetric("cfp/total_drift", "`norm(Delta)` over every covered parameter", "every logging step")
LAM = LoggedMetric(
    "cfp/<anchor>/lam",
    'the lam_t of the step (with `kl_budget` under `kl_control="adaptive"`: the controller\'s latest, which a '
    "measurement at this step has set)",
    "every logging step, per protecting anchor",
)
ADAPTER_RESIDUAL = LoggedMetric(
    "cfp/<anchor>/adapter_residual",
    "the share of the CFP target `Delta / (1 + lam F)` the LoRA factors could not represent",
    "every logging step on a PeftModel with LoRA-adapted weights, for the first protecting anchor",
)
SUMMED_ITERATIONS = LoggedMetric(
    "cfp/summed_iterations",
    "the conjugate-gradient iterations per weight of the last correction's summed proximal map",
    "every logging step when several protecting anchors cover a K-FAC weight",
)
TOP1_OVERLAP_NOW = LoggedMetric(
    "cfp/<anchor>/top1_overlap_now",
    "the share of the anchor's top-1% coordinates still in the top 1% of F re-estimated at the current weights",
    "with `recheck_every`: the logging step after each recheck, per protecting anchor",
)
MEASURED_KL = LoggedMetric(
    "cfp/<anchor>/measured_kl",
    "the KL to the base on the base responses of `kl_prompts` at the last measurement, nats: what `kl_budget` holds",
    "every logging step with `kl_budget` (measured every `kl_every` steps), per protecting anchor",
)
LAM_CAPPED = LoggedMetric(
    "cfp/<anchor>/lam_capped",
    "1 when the step's lam_t was held at its cap (a pull of 1e4 at the 99th percentile of F): the budget may not be "
    "met, and a warning said so; else 0",
    'every logging step with `kl_budget` under `kl_control="feedforward"`, per protecting anchor',
)
KL_TO_BASE = LoggedMetric(
    "cfp/<name>/kl_to_base",
    "the KL from the base model to the current one, estimated on the base model's sampled responses to "
    "held-out prompts, nats",
    "every logging step, with `KLToBaseCallback(..., name=<name>)`",
)
KL_TO_BASE_STDERR = LoggedMetric(
    "cfp/<name>/kl_to_base_stderr", "the standard error of `kl_to_base`", "with `kl_to_base`"
)

LOGGED_METRICS = (
    SENSITIVE_DRIFT,
    PREDICTED_KL,
    FREE_DRIFT,
    TOTAL_DRIFT,
    LAM,
    ADAPTER_RESIDUAL,
    SUMMED_ITERATIONS,
    TOP1_OVERLAP_NOW,
    MEASURED_KL,
    LAM_CAPPED,
    KL_TO_BASE,
    KL_TO_BASE_STDERR,
)


def drift_keys(anchors: Iterable[str]) -> list[str]:
    """The keys of the drift sums in the order `ops.drift.drift_squares` returns them: `cfp/total_drift`, then
    `cfp/<anchor>/sensitive_drift` and `cfp/<anchor>/free_drift` for each anchor in turn."""
    return [TOTAL_DRIFT.key()] + [metric.key(a) for a in anchors for metric in (SENSITIVE_DRIFT, FREE_DRIFT)]


def metrics_table() -> str:
    """The "Logged metrics" table of the README, rendered from `LOGGED_METRICS`: one markdown row per metric,
    `| key | value | logged |` (Delta = theta - theta0). tests/unit/test_names.py checks that the README holds
    exactly this text.

    Returns:
        `str`: the markdown table, one line per row, without a trailing newline.
    """
    rows = ["| key | value | logged |", "|---|---|---|"]
    rows += [f"| `{m.pattern}` | {m.meaning} | {m.logged} |" for m in LOGGED_METRICS]
    return "\n".join(rows)
