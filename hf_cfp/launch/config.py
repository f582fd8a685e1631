"""CFPConfig: the `cfp_*` options of config-driven training, read by TRL's parser from YAML and the command line,
checked when built, and turned into the `CFPCallback` they describe."""

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..anchor.hub import looks_like_local_path, parse_reference
from ..errors import AnchorValidationError, CFPArgumentError
from ..integrations import CFPCallback
from ..integrations.recheck import AnchorRecheck
from ..integrations.strength import Strength
from ..loading.prompts import CALIBRATION_SETS, load_prompts
from ..ops.lora_correction import LORA_RULES
from ..protection import MemoryPlan

PROMPT_SOURCES = f"a bundled calibration set ({', '.join(CALIBRATION_SETS)}) or a .jsonl/.json/.txt file of prompts"


@dataclass
class CFPConfig:
    r"""
    Configuration of Cumulative Fisher Protection for config-driven training (`hf-cfp train {sft,dpo,grpo}`).

    Each field is a [`CFPCallback`] argument with a `cfp_` prefix, so that it never collides with the keys of TRL's
    configs: [`~trl.TrlParser`] and [`~transformers.HfArgumentParser`] read it from a YAML file (`cfp_lam: 10.0`) or
    the command line (`--cfp_lam 10.0`; lists as `--cfp_anchor a b`). The values are checked when the config is
    built (`__post_init__`), before any model is loaded; [`~CFPConfig.build_callback`] makes the callback.

    Args:
        cfp_anchor (`str` or `list[str]`):
            The protecting anchor(s): directories written by `FisherAnchor.save_pretrained` (write local paths as
            `./anchors/math` or absolute) or Hub references `org/model[@revision][:subfolder]`. Required.
        cfp_lam (`float` or `list[float]`, *optional*):
            The strength lam >= 0: one for every protecting anchor, or one per anchor. Defaults to 1.0 unless
            `cfp_kl_budget` is given. Each step theta <- theta0 + (theta - theta0) / (1 + sum_k lam_k F_k).
        cfp_kl_budget (`float` or `list[float]`, *optional*):
            Instead of `cfp_lam`: a budget in nats (> 0) on the predicted KL 0.5 Delta^T F Delta; lam_t is solved at
            every step to hold it.
        cfp_scale_lam_with_lr (`bool`, *optional*, defaults to `False`):
            Multiply lam by each step's learning rate.
        cfp_monitor (`list[str]`, *optional*):
            Anchors (directories or Hub references) whose drift is logged but not corrected.
        cfp_free_fraction (`float`, *optional*, defaults to `0.99`):
            Share of coordinates, by smallest F, that `cfp/<anchor>/free_drift` runs over; in (0, 1).
        cfp_fisher_dtype (`str`, *optional*, defaults to `"float32"`):
            The dtype F is kept in on the device: `"float32"` or `"bfloat16"`.
        cfp_sparse (`float`, *optional*):
            Correct only the top `cfp_sparse` share (in (0, 1)) of each anchor's F.
        cfp_sparse_by (`str`, *optional*, defaults to `"coordinates"`):
            What `cfp_sparse` is a share of: `"coordinates"` or `"mass"`.
        cfp_lora_rule (`str`, *optional*, defaults to `"proximal_b"`):
            How LoRA-adapted weights are corrected (`--use_peft`): `"proximal_b"`, `"least_squares_b"` or
            `"factor_space"`.
        cfp_strict (`bool`, *optional*, defaults to `True`):
            An anchor computed for another base model raises an error; `False` (`--no_cfp_strict`) only warns.
        cfp_restart_path_on_resume (`bool`, *optional*, defaults to `False`):
            Resuming from a checkpoint without saved theta0 restarts the protected path instead of raising.
        cfp_compute_if_missing (`str`, *optional*):
            Calibration prompts (`PROMPT_SOURCES`) to estimate the anchor from at train begin when `cfp_anchor` (one
            Hub reference) does not exist yet.
        cfp_push_if_computed (`bool`, *optional*, defaults to `False`):
            Push an anchor computed that way to its Hub reference.
        cfp_recheck_every (`int`, *optional*):
            Every this many optimizer steps, re-estimate F on `cfp_recheck_prompts` and log
            `cfp/<anchor>/top1_overlap_now`.
        cfp_recheck_prompts (`str`, *optional*):
            The calibration prompts for `cfp_recheck_every` (`PROMPT_SOURCES`).
        cfp_refresh_fisher (`bool`, *optional*, defaults to `False`):
            With `cfp_recheck_every`: adopt each re-estimated F from then on.

    Raises:
        CFPArgumentError: a value out of range, a missing `cfp_anchor`, an anchor directory or prompt file that does
            not exist; the message names the `cfp_` field.

    Example:

    ```yaml
    # cfg.yaml, for `hf-cfp train dpo --config cfg.yaml --cfp_lam 20`
    model_name_or_path: smollm2-135m
    dataset_name: hf_cfp/loading/data/pirate_preferences.jsonl
    cfp_anchor: ./anchors/math
    cfp_lam: 10.0
    ```
    """

    cfp_anchor: list[str] | None = field(
        default=None,
        metadata={"help": "Protecting anchor(s): ./local/dir or Hub reference org/model[@revision][:subfolder]."},
    )
    cfp_lam: list[float] | None = field(
        default=None,
        metadata={"help": "Strength lam >= 0, one for all anchors or one per anchor (default 1.0 without kl_budget)."},
    )
    cfp_kl_budget: list[float] | None = field(
        default=None,
        metadata={"help": "Instead of cfp_lam: predicted-KL budget in nats (> 0), lam_t solved every step."},
    )
    cfp_scale_lam_with_lr: bool = field(
        default=False, metadata={"help": "Multiply lam by the learning rate of each step."}
    )
    cfp_monitor: list[str] | None = field(
        default=None, metadata={"help": "Anchors whose drift is logged but not corrected."}
    )
    cfp_free_fraction: float = field(
        default=0.99, metadata={"help": "Share of coordinates, by smallest F, that free_drift covers; in (0, 1)."}
    )
    cfp_fisher_dtype: str = field(
        default="float32", metadata={"help": "dtype F is kept in on the device: float32 or bfloat16."}
    )
    cfp_sparse: float | None = field(
        default=None, metadata={"help": "Correct only the top share (in (0, 1)) of each anchor's F."}
    )
    cfp_sparse_by: str = field(
        default="coordinates", metadata={"help": "What cfp_sparse is a share of: coordinates or mass."}
    )
    cfp_lora_rule: str = field(
        default="proximal_b",
        metadata={"help": f"Correction of LoRA-adapted weights: one of {', '.join(sorted(LORA_RULES))}."},
    )
    cfp_strict: bool = field(
        default=True, metadata={"help": "An anchor of another base model is an error (--no_cfp_strict: a warning)."}
    )
    cfp_restart_path_on_resume: bool = field(
        default=False, metadata={"help": "Resuming from a checkpoint without saved theta0 restarts the path."}
    )
    cfp_compute_if_missing: str | None = field(
        default=None, metadata={"help": f"Estimate a missing anchor at train begin from {PROMPT_SOURCES}."}
    )
    cfp_push_if_computed: bool = field(
        default=False, metadata={"help": "Push an anchor computed at train begin to its Hub reference."}
    )
    cfp_recheck_every: int | None = field(
        default=None, metadata={"help": "Re-estimate F every this many optimizer steps (logs top1_overlap_now)."}
    )
    cfp_recheck_prompts: str | None = field(
        default=None, metadata={"help": f"Prompts for cfp_recheck_every: {PROMPT_SOURCES}."}
    )
    cfp_refresh_fisher: bool = field(
        default=False, metadata={"help": "With cfp_recheck_every: adopt each re-estimated F."}
    )

    def __post_init__(self) -> None:
        self.cfp_anchor = _as_list(self.cfp_anchor)
        self.cfp_monitor = _as_list(self.cfp_monitor)
        self.cfp_lam = _as_list(self.cfp_lam)
        self.cfp_kl_budget = _as_list(self.cfp_kl_budget)
        if not self.cfp_anchor:
            raise CFPArgumentError(
                "cfp_anchor is required: the protecting anchor(s), each a directory saved by "
                "FisherAnchor.save_pretrained (e.g. `hf-cfp estimate --output anchors/math`, then "
                "`cfp_anchor: ./anchors/math`) or a Hub reference org/model[@revision][:subfolder]."
            )
        for reference in self.cfp_anchor:
            _check_reference("cfp_anchor", reference)
        for reference in self.cfp_monitor or ():
            _check_reference("cfp_monitor", reference)
        self._check_strength()
        if not 0 < self.cfp_free_fraction < 1:
            raise CFPArgumentError(
                f"cfp_free_fraction must be in (0, 1), got {self.cfp_free_fraction!r}; the paper uses 0.99."
            )
        if self.cfp_lora_rule not in LORA_RULES:
            raise CFPArgumentError(f"cfp_lora_rule must be one of {sorted(LORA_RULES)}, got {self.cfp_lora_rule!r}.")
        with _naming_fields():
            MemoryPlan(self.cfp_fisher_dtype, self.cfp_sparse, self.cfp_sparse_by)
        self._prompts("cfp_compute_if_missing", self.cfp_compute_if_missing)
        with _naming_fields():  # anchor names are known once loaded: the references stand in for them here
            AnchorRecheck(
                self.cfp_recheck_every,
                self._prompts("cfp_recheck_prompts", self.cfp_recheck_prompts),
                self.cfp_refresh_fisher,
                list(self.cfp_anchor),
            )
        if self.cfp_push_if_computed and self.cfp_compute_if_missing is None:
            raise CFPArgumentError("cfp_push_if_computed needs cfp_compute_if_missing (the prompts to estimate from).")

    def build_callback(self) -> CFPCallback:
        """The [`CFPCallback`] these fields describe. Anchors given by reference are loaded here (lazily: headers
        and metadata only), so a missing Hub anchor or a corrupt directory fails before any model is loaded.

        Returns:
            [`CFPCallback`]: the callback to pass to the trainer (`callbacks=[...]`).

        Raises:
            CFPError: an anchor that cannot be loaded, or arguments the callback refuses together.
        """
        lam, kl_budget = self._strength_arguments()
        with _naming_fields():  # what only shows together with the anchors, e.g. compute_if_missing with two
            return CFPCallback(
                list(self.cfp_anchor or ()),
                lam=lam,
                monitor=self.cfp_monitor or (),
                free_fraction=self.cfp_free_fraction,
                compute_if_missing=self._prompts("cfp_compute_if_missing", self.cfp_compute_if_missing),
                push_if_computed=self.cfp_push_if_computed,
                strict=self.cfp_strict,
                restart_path_on_resume=self.cfp_restart_path_on_resume,
                lora_rule=self.cfp_lora_rule,
                kl_budget=kl_budget,
                scale_lam_with_lr=self.cfp_scale_lam_with_lr,
                recheck_every=self.cfp_recheck_every,
                recheck_prompts=self._prompts("cfp_recheck_prompts", self.cfp_recheck_prompts),
                refresh_fisher=self.cfp_refresh_fisher,
                fisher_dtype=self.cfp_fisher_dtype,
                sparse=self.cfp_sparse,
                sparse_by=self.cfp_sparse_by,
            )

    def _strength_arguments(self) -> tuple[Any, Any]:
        """(lam, kl_budget) as CFPCallback takes them: one value stands for every protecting anchor."""
        return _one_or_all(self.cfp_lam), _one_or_all(self.cfp_kl_budget)

    def _check_strength(self) -> None:
        """lam or kl_budget, checked with the callback's own rules."""
        lam, kl_budget = self._strength_arguments()
        with _naming_fields():
            Strength.from_arguments(lam, kl_budget, self.cfp_scale_lam_with_lr, len(self.cfp_anchor or ()))

    @staticmethod
    def _prompts(field_name: str, source: str | None) -> list | None:
        """The prompts `source` names (None stays None), or CFPArgumentError naming `field_name`."""
        if source is None:
            return None
        try:
            return load_prompts(source)
        except (CFPArgumentError, OSError, ValueError, KeyError) as error:
            raise CFPArgumentError(
                f"{field_name}: cannot read prompts from {source!r} ({error}); give {PROMPT_SOURCES}."
            ) from None


def _as_list(value: Any) -> list | None:
    """None, or `value` as a list (YAML and Python may give one value where the command line gives a list)."""
    if value is None:
        return None
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _one_or_all(values: list | None) -> Any:
    return values[0] if values is not None and len(values) == 1 else values


def _check_reference(field_name: str, reference: Any) -> None:
    """An existing directory, or a Hub reference `org/model[@revision][:subfolder]` (a reference that looks like a
    local path, `looks_like_local_path`, must exist)."""
    if not isinstance(reference, str) or not reference:
        raise CFPArgumentError(f"{field_name} entries must be non-empty strings, got {reference!r}.")
    if Path(reference).is_dir():
        return
    if looks_like_local_path(reference) or Path(reference).exists():
        raise CFPArgumentError(
            f"{field_name}: no anchor directory at {reference!r}. Save one there with `hf-cfp estimate --output "
            f"{reference}` (or FisherAnchor.save_pretrained), or give a Hub reference "
            "org/model[@revision][:subfolder]."
        )
    try:
        parse_reference(reference)
    except AnchorValidationError:
        raise CFPArgumentError(
            f"{field_name}: {reference!r} is neither an anchor directory nor a Hub reference like "
            "'org/model:cfp/math' (write local paths as ./dir or absolute)."
        ) from None


@contextlib.contextmanager
def _naming_fields() -> Iterator[None]:
    """Re-raise the callback's own argument errors with the field names: "lam must be ..." -> "cfp_lam must be
    ..." (each argument name in the message gets the `cfp_` prefix)."""
    try:
        yield
    except CFPArgumentError as error:
        raise CFPArgumentError(_CALLBACK_ARGUMENT.sub(r"cfp_\1", str(error))) from None


_CALLBACK_ARGUMENT = re.compile(
    r"\b(lam|kl_budget|scale_lam_with_lr|fisher_dtype|sparse|sparse_by|recheck_every|recheck_prompts|refresh_fisher"
    r"|compute_if_missing|push_if_computed)\b"
)
