"""An Axolotl plugin: `plugins: [hf_cfp.launch.axolotl.CFPPlugin]` in an Axolotl YAML, and the `cfp_*` keys of
[`CFPConfig`] beside Axolotl's own (`cfp_anchor: ./anchors/math`, `cfp_lam: 200.0`, ...).

Axolotl merges `CFPArgs` into its config schema (`get_input_args`), so a value `CFPConfig` refuses fails Axolotl's
config validation, naming the key, before any model loads; then `add_callbacks_pre_trainer` gives Axolotl's
trainer the `CFPCallback` the keys describe. Only Axolotl imports this module (it imports axolotl). Tested
against Axolotl 0.19's own `BasePlugin`, `load_plugin`, `DictDefault` and config-schema merge, not through a
whole Axolotl run: Axolotl 0.19 pins transformers 5.16.1 and trl 1.9.0, older than this project's test stack.
"""

from typing import Any

from axolotl.integrations.base import BasePlugin
from pydantic import BaseModel, create_model, model_validator

from ..errors import CFPArgumentError
from ..integrations import CFPCallback
from .config import CONFIG_KEYS, CFPConfig


class _CFPKeys(BaseModel):
    """What `CFPArgs` adds to the fields: the `CFPConfig` they make, checked when the config is validated."""

    def cfp_config(self) -> CFPConfig | None:
        """The `CFPConfig` of the given `cfp_*` keys (absent ones take CFPConfig's defaults); None without
        `cfp_anchor`."""
        given = {key: value for key in CONFIG_KEYS if (value := getattr(self, key, None)) is not None}
        return CFPConfig(**given) if given.get("cfp_anchor") else None

    @model_validator(mode="after")
    def _check_cfp_keys(self) -> "_CFPKeys":
        self.cfp_config()  # CFPConfig.__post_init__ raises CFPArgumentError (a ValueError) naming the key
        return self


# The cfp_* keys for Axolotl's (pydantic) config schema: each optional, typed and checked by CFPConfig
CFPArgs = create_model("CFPArgs", __base__=_CFPKeys, **{key: (Any, None) for key in CONFIG_KEYS})  # type: ignore[call-overload]


class CFPPlugin(BasePlugin):
    """Cumulative Fisher Protection in Axolotl: its `cfp_*` config keys and the callback they describe."""

    def get_input_args(self) -> str:
        """The pydantic model of the plugin's config keys, as Axolotl imports it."""
        return f"{__name__}.CFPArgs"

    def add_callbacks_pre_trainer(self, cfg: Any, model: Any) -> list[CFPCallback]:
        """The `CFPCallback` of `cfg`'s `cfp_*` keys, for the trainer Axolotl is about to build.

        Args:
            cfg (`DictDefault`): Axolotl's validated config (a missing key reads as None).
            model (`PreTrainedModel`): the loaded model (the callback binds to it at train begin).

        Raises:
            CFPArgumentError: no `cfp_anchor`, or a value CFPConfig refuses (naming the key).
            CFPError: an anchor that cannot be loaded.
        """
        config = CFPArgs(**{key: cfg.get(key) for key in CONFIG_KEYS}).cfp_config()
        if config is None:
            raise CFPArgumentError(
                "CFPPlugin is in the Axolotl config's plugins but cfp_anchor is not set: add "
                "`cfp_anchor: ./anchors/math` (a directory from `hf-cfp estimate --output anchors/math`, or a Hub "
                "reference org/model[@revision][:subfolder]), or remove the plugin."
            )
        return [config.build_callback()]
