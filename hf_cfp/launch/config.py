"""CFPConfig: the `cfp_*` options of config-driven training, one key per option of the declaration
(`hf_cfp.integrations.options`) that CFPConfig takes, read by TRL's parser from YAML and the command line, checked
when built, and turned into the `CFPCallback` they describe."""

from collections.abc import Callable
from dataclasses import MISSING, Field, dataclass, field
from pathlib import Path
from typing import Any

from ..anchor.hub import looks_like_local_path, parse_reference
from ..errors import AnchorValidationError, CFPArgumentError
from ..integrations import CFPCallback
from ..integrations.loop import anchor_list
from ..integrations.options import (
    ANCHORS,
    CALLBACK,
    CONFIG,
    CONFIG_PREFIX,
    NUMBERS,
    PROMPTS,
    VALUE,
    ProtectionOptions,
    options_on,
)
from ..integrations.settings import ProtectionSettings
from ..integrations.surfaces import argument_head, documents_options, shown_type
from ..loading.prompts import CALIBRATION_SETS, load_prompts

CONFIG_KEYS = [CONFIG_PREFIX + option.name for option in options_on(CONFIG)]  # CFPConfig's fields, Axolotl's keys
PROMPT_SOURCES = f"a bundled calibration set ({', '.join(CALIBRATION_SETS)}) or a .jsonl/.json/.txt file of prompts"


def _read_prompts(key: str, source: str | None) -> list | None:
    """The prompts `source` names (None stays None), or CFPArgumentError naming `key`."""
    if source is None:
        return None
    try:
        return load_prompts(source)
    except (CFPArgumentError, OSError, ValueError, KeyError) as error:
        raise CFPArgumentError(
            f"{key}: cannot read prompts from {source!r} ({error}); give {PROMPT_SOURCES}."
        ) from None


def _as_list(value: Any) -> list | None:
    """None, or `value` as a list (YAML and Python may give one value where the command line gives a list)."""
    if value is None:
        return None
    return list(value) if isinstance(value, (list, tuple)) else [value]


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


@dataclass(frozen=True)
class KeyForm:
    """How a `cfp_` key holds an option of one form (`options.VALUE`, `ANCHORS`, `NUMBERS`, `PROMPTS`): the key's
    type for TRL's parser (None: the option's own type and default; else the default is None), the type as the
    docstring shows it (None: the option's), what the key's help adds, whether one value stands for a list of one
    (YAML and Python may give one value where the command line gives a list), and `read(key, value)`: the
    option's value from the key's."""

    type: Any
    shown_type: str | None
    note: str
    listed: bool
    read: Callable[[str, Any], Any]


KEY_FORMS = {
    VALUE: KeyForm(None, None, "", False, lambda key, value: value),
    ANCHORS: KeyForm(
        list[str] | None,
        "`str` or `list[str]`",
        "From YAML or the command line: directories (write local paths as `./anchors/math` or absolute) or Hub "
        "references `org/model[@revision][:subfolder]`.",
        True,
        lambda key, value: tuple(value or ()),
    ),
    NUMBERS: KeyForm(
        list[float] | None,
        "`float` or `list[float]`",
        "From YAML or the command line: one number for every protecting anchor, or a list of one per anchor.",
        True,
        lambda key, values: values[0] if values is not None and len(values) == 1 else values,
    ),
    PROMPTS: KeyForm(str | None, "`str`", f"From YAML or the command line: {PROMPT_SOURCES}.", False, _read_prompts),
}


def key_of(option: Field) -> tuple[str, Any, Any]:
    """The `cfp_` key of `option` as CFPConfig declares it: its name, its type for TRL's parser (the option's own
    for a value, else its form's) and its default (the option's for a value, else None)."""
    form = KEY_FORMS[option.metadata["form"]]
    if form.type is None:
        return CONFIG_PREFIX + option.name, option.type, option.default
    return CONFIG_PREFIX + option.name, form.type, None


def key_help(option: Field) -> str:
    """What the `cfp_` key of `option` says (`--help`, the docstring): the option's help, then its form's note."""
    return " ".join(part for part in (option.metadata["help"], KEY_FORMS[option.metadata["form"]].note) if part)


def _key_entries() -> list[tuple[str, str]]:
    """CFPConfig's `Args:` entries: one per `cfp_` key, typed as its form shows it; a required one says so."""
    entries = []
    for option in options_on(CONFIG):
        key, _, default = key_of(option)
        required = option.default is MISSING
        type_text = KEY_FORMS[option.metadata["form"]].shown_type or shown_type(option)
        head = argument_head(key, type_text, MISSING if required else default)
        entries.append((head, key_help(option) + (" Required." if required else "")))
    return entries


def _described(name: str) -> dict[str, str]:
    """The metadata of option `name`'s `cfp_` field: its help as TRL's parser shows it (`--help`; `%` escaped for
    argparse's format)."""
    (option,) = (o for o in options_on(CONFIG) if o.name == name)
    return {"help": key_help(option).replace("%", "%%")}


@documents_options(_key_entries())
@dataclass
class CFPConfig:
    r"""
    Configuration of Cumulative Fisher Protection for config-driven training (`hf-cfp train {sft,dpo,grpo}`).

    Each field is a [`CFPCallback`] argument with a `cfp_` prefix, so that it never collides with the keys of TRL's
    configs: [`~trl.TrlParser`] and [`~transformers.HfArgumentParser`] read it from a YAML file (`cfp_lam: 10.0`) or
    the command line (`--cfp_lam 10.0`; lists as `--cfp_anchor a b`). There is one field per option of the
    declaration (`hf_cfp.integrations.options.ProtectionOptions`) that CFPConfig takes, each key holding its option
    in its form: anchor references, numbers (one or one per anchor), a prompt source, or the value itself; their
    help is the declaration's. The values are checked when the config is built (`__post_init__`), by the callback's
    own rules with the keys' names, before any model is loaded; [`~CFPConfig.build_callback`] makes the callback.

    Args:

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

    # The cfp_ keys in the declaration's order, each typed and defaulted as `key_of` gives it (tested)
    cfp_anchor: list[str] | None = field(default=None, metadata=_described("anchor"))
    cfp_lam: list[float] | None = field(default=None, metadata=_described("lam"))
    cfp_kl_budget: list[float] | None = field(default=None, metadata=_described("kl_budget"))
    cfp_kl_prompts: str | None = field(default=None, metadata=_described("kl_prompts"))
    cfp_kl_every: int = field(default=8, metadata=_described("kl_every"))
    cfp_kl_control: str = field(default="feedforward", metadata=_described("kl_control"))
    cfp_predicted_kl_budget: list[float] | None = field(default=None, metadata=_described("predicted_kl_budget"))
    cfp_scale_lam_with_lr: bool = field(default=False, metadata=_described("scale_lam_with_lr"))
    cfp_monitor: list[str] | None = field(default=None, metadata=_described("monitor"))
    cfp_free_fraction: float = field(default=0.99, metadata=_described("free_fraction"))
    cfp_fisher_dtype: str = field(default="float32", metadata=_described("fisher_dtype"))
    cfp_sparse: float | None = field(default=None, metadata=_described("sparse"))
    cfp_sparse_by: str = field(default="coordinates", metadata=_described("sparse_by"))
    cfp_lora_rule: str = field(default="proximal_b", metadata=_described("lora_rule"))
    cfp_strict: bool = field(default=True, metadata=_described("strict"))
    cfp_restart_path_on_resume: bool = field(default=False, metadata=_described("restart_path_on_resume"))
    cfp_compute_if_missing: str | None = field(default=None, metadata=_described("compute_if_missing"))
    cfp_push_if_computed: bool = field(default=False, metadata=_described("push_if_computed"))
    cfp_recheck_every: int | None = field(default=None, metadata=_described("recheck_every"))
    cfp_recheck_prompts: str | None = field(default=None, metadata=_described("recheck_prompts"))
    cfp_refresh_fisher: bool = field(default=False, metadata=_described("refresh_fisher"))

    def __post_init__(self) -> None:
        for option in options_on(CONFIG):
            key = CONFIG_PREFIX + option.name
            if KEY_FORMS[option.metadata["form"]].listed:
                setattr(self, key, _as_list(getattr(self, key)))
            if option.metadata["form"] == ANCHORS:
                for reference in getattr(self, key) or ():
                    _check_reference(key, reference)
        options = self.protection_options()
        # the callback's own rules; the anchors' references stand in for their names until they load
        ProtectionSettings.of(options, [str(r) for r in anchor_list(options.anchor)], (), CONFIG_PREFIX)

    def protection_options(self) -> ProtectionOptions:
        """The options these keys give (each read in its form: prompt sources loaded, one number for all anchors),
        the others at their defaults.

        Raises:
            CFPArgumentError: a prompt source that cannot be read (naming its key).
        """
        keys = {o.name: (KEY_FORMS[o.metadata["form"]], CONFIG_PREFIX + o.name) for o in options_on(CONFIG)}
        return ProtectionOptions(**{name: form.read(key, getattr(self, key)) for name, (form, key) in keys.items()})

    def build_callback(self) -> CFPCallback:
        """The [`CFPCallback`] these fields describe. Anchors given by reference are loaded here (lazily: headers
        and metadata only), so a missing Hub anchor or a corrupt directory fails before any model is loaded.

        Returns:
            [`CFPCallback`]: the callback to pass to the trainer (`callbacks=[...]`).

        Raises:
            CFPError: an anchor that cannot be loaded, or anchor names that are not unique.
        """
        return CFPCallback(**self.protection_options().arguments(CALLBACK))
