"""CFPConfig: the `cfp_*` options of config-driven training, one key per option of the declaration
(`hf_cfp.integrations.options`) that CFPConfig takes, read by TRL's parser from YAML and the command line, checked
when built, and turned into the `CFPCallback` they describe."""

from collections.abc import Callable
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

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
from ..integrations.surfaces import argument_head, shown_type, with_arguments
from ..loading.prompts import CALIBRATION_SETS, load_prompts

CONFIG_KEYS = [CONFIG_PREFIX + option.name for option in options_on(CONFIG)]  # CFPConfig's fields, Axolotl's keys
PROMPT_SOURCES = f"a bundled calibration set ({', '.join(CALIBRATION_SETS)}) or a .jsonl/.json/.txt file of prompts"

Config = TypeVar("Config")


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


def _with_cfp_keys(cls: type[Config]) -> type[Config]:
    """`cls` as a dataclass with one field `cfp_<name>` per option that CFPConfig takes, typed and defaulted as its
    form holds it (TRL's parser reads both from the field), its help the option's and the form's note (what
    `--help` shows), and each in the docstring's `Args:`."""
    cls.__annotations__ = {}
    entries = []
    for option in options_on(CONFIG):
        form, key = KEY_FORMS[option.metadata["form"]], CONFIG_PREFIX + option.name
        default = option.default if form.type is None else None
        text = " ".join(part for part in (option.metadata["help"], form.note) if part)
        cls.__annotations__[key] = form.type or option.type
        setattr(cls, key, field(default=default, metadata={"help": text.replace("%", "%%")}))  # argparse's % format
        required = option.default is MISSING
        head = argument_head(key, form.shown_type or shown_type(option), MISSING if required else default)
        entries.append((head, text + (" Required." if required else "")))
    cls.__doc__ = with_arguments(cls.__doc__, entries)
    return dataclass(cls)


@_with_cfp_keys
class CFPConfig:
    r"""
    Configuration of Cumulative Fisher Protection for config-driven training (`hf-cfp train {sft,dpo,grpo}`).

    Each field is a [`CFPCallback`] argument with a `cfp_` prefix, so that it never collides with the keys of TRL's
    configs: [`~trl.TrlParser`] and [`~transformers.HfArgumentParser`] read it from a YAML file (`cfp_lam: 10.0`) or
    the command line (`--cfp_lam 10.0`; lists as `--cfp_anchor a b`). The fields are written from the option
    declaration (`hf_cfp.integrations.options.ProtectionOptions`), each option's key holding it in its form: anchor
    references, numbers (one or one per anchor), a prompt source, or the value itself. The values are checked when
    the config is built (`__post_init__`), by the callback's own rules with the keys' names, before any model is
    loaded; [`~CFPConfig.build_callback`] makes the callback.

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
