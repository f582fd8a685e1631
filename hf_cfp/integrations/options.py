"""Every protection option, declared once: `ProtectionOptions`, one field per option with its type, default, help
text, the surfaces that take it and the form a YAML key holds it in (as PEFT's `LoraConfig` declares LoRA's).

The surfaces state the options they take statically, so that type checkers and editors see them: `CFPCallback` and
`CFP` as keyword parameters of `__init__` (`signature_of` is the signature the declaration gives each; a call's
arguments become options by `ProtectionOptions.of_call`), `CFPConfig` (`hf_cfp.launch`: YAML, `hf-cfp train` and
the Axolotl plugin) as one `cfp_` field per option. Their docstrings' `Args:` entries are written from the
declaration (`surfaces.documents_options`), and tests fail when a surface's parameters, types or defaults drift
from it. The options are validated in one place, `settings.ProtectionSettings.of`, which names each option as the
surface does (`lam` or `cfp_lam`).

To add an option: one `option(...)` field below (with `on=` if not every surface takes it), the same parameter on
each surface that takes it (a `cfp_` field of `CFPConfig` in its key's form), then its use.
"""

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any

import torch

from ..protection.theta0 import Theta0Reader
from .resolve import AnchorLike
from .strength import LamSchedule

# The surfaces: the Trainer callback, the loop API, and the `cfp_` keys of config-driven training
CALLBACK, LOOP, CONFIG = "CFPCallback", "CFP", "CFPConfig"
EVERYWHERE = frozenset({CALLBACK, LOOP, CONFIG})
CONFIG_PREFIX = "cfp_"  # an option's key in CFPConfig: `cfp_lam`, `cfp_predicted_kl_budget`, ...

# The forms a `cfp_` key holds an option in (`hf_cfp.launch.config` reads each): the value itself; anchor
# references (one or a list); numbers, one for every protecting anchor or one per anchor; a prompt source
VALUE, ANCHORS, NUMBERS, PROMPTS = "value", "anchors", "numbers", "prompts"

BY_POSITION = ("anchor", "lam")  # also taken by position: CFPCallback(anchor, 10.0), CFP(model, anchor, 10.0)


def option(
    default: Any = MISSING,
    *,
    help: str,
    on: frozenset[str] = EVERYWHERE,
    form: str = VALUE,
    shown_type: str | None = None,
) -> Any:
    """One option's field: `default` (none: required), `help` (the docstrings' and `--help`'s text), the surfaces
    it is `on`, its `form` as a `cfp_` key, and its type as the docstrings show it (`shown_type`; by default the
    annotation's, for `bool`, `int`, `float` and `str`, optional or not)."""
    return field(default=default, metadata={"help": help, "on": on, "form": form, "shown_type": shown_type})


@dataclass(frozen=True, kw_only=True)
class ProtectionOptions:
    """The options of one protected run, as given (`of_call` reads a call's; `settings.ProtectionSettings.of`
    validates them)."""

    anchor: AnchorLike | Sequence[AnchorLike] = option(
        form=ANCHORS,
        shown_type="[`FisherAnchor`], `str` or `os.PathLike`, or a sequence of them",
        help="The protecting anchor(s): an anchor, a directory it was saved to (`FisherAnchor.save_pretrained`, "
        "`hf-cfp estimate --output`), or a Hub reference `org/model@revision:subfolder` (revision and subfolder "
        "optional).",
    )
    lam: float | Sequence[float] | LamSchedule | None = option(
        None,
        form=NUMBERS,
        shown_type="`float`, sequence of `float` or `Callable[[int], float | Sequence[float]]`",
        help="The strength lam >= 0 (one per protecting anchor, or one for all), or a schedule `step -> lam` called "
        "with the optimizer step just taken (1-based); each step theta <- theta0 + (theta - theta0) / "
        "(1 + sum_k lam_k F_k). Defaults to `1.0` unless `predicted_kl_budget` is given; with `kl_budget`, the "
        "starting lam of the controller. Its meaning depends on the Fisher's scale: lam * F_i = 1 halves "
        "coordinate i's displacement each step (see the guide on choosing the strength, "
        "docs/guides/strength.md). The paper uses 1 for PPO and 10 for DPO.",
    )
    kl_budget: float | Sequence[float] | None = option(
        None,
        form=NUMBERS,
        shown_type="`float` or sequence of `float`",
        help="Hold each protecting anchor's measured KL to the base (nats, > 0; one per protecting anchor, or one for "
        "all) on `kl_prompts`, measured on their base responses every `kl_every` optimizer steps (and at steps 1, 2, "
        "4, ... before the first) and held by the controller `kl_control`, starting from `lam` (> 0). Logged as "
        "`cfp/<anchor>/measured_kl`. Full-parameter and PEFT training (`hf_cfp.integrations.kl_control`).",
    )
    kl_prompts: Any = option(
        None,
        form=PROMPTS,
        shown_type="prompts, `BaseResponses`, or `dict` of anchor name -> either",
        help="Held-out prompts of each protecting anchor's capability, where `kl_budget` is measured (any form "
        "`estimate_fisher` takes; CFPCallback draws 4 base responses per prompt at train begin), or base responses "
        "drawn already with `hf_cfp.evaluation.draw_base_responses` (what `CFP` needs for text prompts).",
    )
    kl_every: int = option(
        8,
        help="Optimizer steps between two measurements of `kl_budget`; each costs one scoring pass over the base "
        "responses of `kl_prompts`. The default held the budget with a K-FAC anchor on the embedded model; a diagonal "
        "anchor needed 2 (docs/reports/strength.md).",
    )
    kl_control: str = option(
        "feedforward",
        help='How `kl_budget` sets lam_t. `"feedforward"` (the default; on the embedded model it held the budget more '
        "closely than the adaptive rule with a diagonal anchor and exactly as it did with a K-FAC one, "
        "docs/reports/strength.md): each measurement rescales a target on the predicted KL 0.5 Delta^T F Delta by "
        "budget / measured KL, and at every step lam_t is solved so that the predicted KL of the step holds that "
        "target, at least a floor that follows the adaptive rule at every `kl_every`-th step, at most a pull of 1e4 "
        "at the 99th percentile of F; where the predicted KL has no closed-form solve (LoRA-adapted weights, a "
        "sparse plan, several protecting anchors on one K-FAC weight) the adaptive rule is used instead. "
        '`"adaptive"`: PPO\'s adaptive KL controller, lam_k <- lam_k (1 + clip(KL_k / budget_k - 1, -0.2, 0.2)) at '
        "each measurement.",
    )
    predicted_kl_budget: float | Sequence[float] | None = option(
        None,
        form=NUMBERS,
        shown_type="`float` or sequence of `float`",
        help="Instead of lam: a budget (> 0; one per protecting anchor, or one for all) on the second-order "
        "prediction of the KL, not the KL itself (see `kl_budget`). At every step lam_t is solved so that the "
        "predicted KL 0.5 (theta - theta0)^T F (theta - theta0) stays within the budget, and "
        "no harder: the correction is the projection of the optimizer's proposal onto the budget, lam_t = 0 while "
        "inside it (`hf_cfp.ops.budget`). Full-parameter and PEFT `modules_to_save` training only, not "
        "LoRA-adapted weights.",
    )
    scale_lam_with_lr: bool = option(
        False,
        help="Multiply lam by the learning rate of each step, eta_t: theta0 + Delta / (1 + eta_t lam F). The pull "
        "then follows warmup and decay, and a persistent step eta_t u settles at u / (lam F), independent of the "
        "learning rate; lam is on another scale (about 1 / lr times the unscaled one).",
    )
    monitor: Sequence[AnchorLike] = option(
        (),
        form=ANCHORS,
        shown_type="sequence of [`FisherAnchor`], `str` or `os.PathLike`",
        help="Anchors whose drift is logged but not corrected.",
    )
    free_fraction: float = option(
        0.99, help="Share of coordinates, by smallest F, that `free_drift` runs over; in (0, 1)."
    )
    fisher_dtype: str = option(
        "float32",
        help='The dtype F is kept in on the training device: `"float32"`, or `"bfloat16"` (half the bytes; the '
        "correction and the metrics still compute in float32). theta0 is kept in the parameters' own dtype.",
    )
    sparse: float | None = option(
        None,
        help="Correct only the coordinates carrying the top `sparse` share (in (0, 1)) of each protecting anchor's F "
        '(of its coordinates, or of its mass with `sparse_by="mass"`); every other coordinate keeps the '
        "optimizer's proposal. The full theta0 and F then live in CPU memory for the metrics, which stay exact. "
        "About (4 + 2 + 4) x `sparse` bytes per parameter on the device; at train begin one log line reports the "
        "mass kept and the largest F dropped. Not with `predicted_kl_budget` or DeepSpeed.",
    )
    sparse_by: str = option("coordinates", help='What `sparse` is a share of: `"coordinates"` or `"mass"`.')
    lora_rule: str = option(
        "proximal_b",
        help='How a LoRA-adapted weight is corrected (PEFT models only): `"proximal_b"`, the exact proximal step '
        'restricted to B (A fixed); `"least_squares_b"`, its unweighted fit; `"factor_space"`, elementwise CFP on '
        "B and A with F pulled back through the adapter (cheaper, not exact). See `hf_cfp.geometry.diagonal.lora`.",
    )
    strict: bool = option(
        True,
        on=frozenset({CALLBACK, CONFIG}),
        help="An anchor computed for another base model (its stored fingerprint differs from the model's names, "
        "shapes, dtypes or sampled weights) raises `AnchorMismatchError`; `False` (`--no_cfp_strict` on the "
        "command line) downgrades that to a warning.",
    )
    restart_path_on_resume: bool = option(
        False,
        on=frozenset({CALLBACK, CONFIG}),
        help="Resuming from a checkpoint that has no saved theta0 (saved without CFP) raises `CFPError`; `True` "
        "takes theta0 from the resumed weights instead, so the protected path starts again there.",
    )
    compute_if_missing: Any = option(
        None,
        on=frozenset({CALLBACK, CONFIG}),
        form=PROMPTS,
        shown_type="prompts",
        help="Calibration prompts (any form `estimate_fisher` takes) used when `anchor` is one reference that does "
        "not exist yet: the anchor is estimated at train begin on the model about to be trained.",
    )
    push_if_computed: bool = option(
        False,
        on=frozenset({CALLBACK, CONFIG}),
        help="Push an anchor computed from `compute_if_missing` to its reference (main process only).",
    )
    estimate_kwargs: dict[str, Any] | None = option(
        None,
        on=frozenset({CALLBACK}),
        shown_type="`dict`",
        help="More arguments for `estimate_fisher` (`num_sequences`, `max_new_tokens`, ...), for "
        "`compute_if_missing`.",
    )
    recheck_every: int | None = option(
        None,
        on=frozenset({CALLBACK, CONFIG}),
        help="Every this many optimizer steps, re-estimate each protecting anchor's F at the current weights on "
        "`recheck_prompts` with the anchor's own settings and log `cfp/<anchor>/top1_overlap_now`, the share of its "
        "top-1% coordinates still in the top 1% (at the next logging step). Costs one `estimate_fisher` of the "
        "anchor's size per anchor. Off by default.",
    )
    recheck_prompts: Any = option(
        None,
        on=frozenset({CALLBACK, CONFIG}),
        form=PROMPTS,
        shown_type="prompts, or `dict` of anchor name -> prompts",
        help="The anchors' calibration prompts, for `recheck_every`.",
    )
    refresh_fisher: bool = option(
        False,
        on=frozenset({CALLBACK, CONFIG}),
        help="With `recheck_every`: adopt each re-estimated F for the correction and the metrics from then on "
        "(theta0 is kept, so the path is still pulled toward the initial weights, along the directions sensitive "
        "now).",
    )
    optimizer: torch.optim.Optimizer | None = option(
        None,
        on=frozenset({LOOP}),
        shown_type="`torch.optim.Optimizer`",
        help="The loop's optimizer; needed for `scale_lam_with_lr` (its learning rate) and under DeepSpeed ZeRO (its "
        "fp32 master weights).",
    )
    theta0: Theta0Reader | None = option(
        None,
        on=frozenset({LOOP}),
        shown_type="`Theta0Reader`",
        help="Where theta0 comes from when it is not the model's weights now: saved pieces, such as a Trainer "
        "checkpoint's (`hf_cfp.protection.SavedTheta0`), as `CFPCallback` resumes. A loop of your own resumes "
        "with `state_dict` and `load_state_dict`.",
    )

    @classmethod
    def of_call(cls, surface: str, arguments: Mapping[str, Any]) -> "ProtectionOptions":
        """The options of a call to `surface`, from its `__init__`'s arguments by name (`locals()`: names that are
        not options of `surface`, such as `self` or `model`, are left out); the options it does not take at their
        defaults."""
        return cls(**{f.name: arguments[f.name] for f in options_on(surface)})

    def arguments(self, surface: str) -> dict[str, Any]:
        """{name: value} of the options `surface` takes, to call it with: `CFP(model, **options.arguments(LOOP))`."""
        return {f.name: getattr(self, f.name) for f in options_on(surface)}


def options_on(surface: str) -> list[Field]:
    """The declared options `surface` takes, in the declaration's order."""
    return [f for f in fields(ProtectionOptions) if surface in f.metadata["on"]]


def signature_of(surface: str) -> inspect.Signature:
    """The options of `surface` as the call parameters the declaration gives them: `BY_POSITION` ones positional or
    keyword, the others keyword-only; each with its declared type and default (required when it has none).
    `CFPCallback.__init__`'s parameters (and `CFP.__init__`'s after `model`) are written out to equal it (tested)."""
    parameters = []
    for f in options_on(surface):
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD if f.name in BY_POSITION else inspect.Parameter.KEYWORD_ONLY
        default = inspect.Parameter.empty if f.default is MISSING else f.default
        parameters.append(inspect.Parameter(f.name, kind, default=default, annotation=f.type))
    return inspect.Signature(parameters)
