"""The Axolotl plugin against Axolotl's own code (0.19, installed without its dependencies by scripts/setup.sh for
dev with trl and peft): `load_plugin` finds it, `validate_config` merges the cfp_* keys into Axolotl's config
schema and refuses a bad one naming it, and `PluginManager.add_callbacks_pre_trainer` returns the CFPCallback the
keys describe."""

import pytest
from support.extras import needs
from support.tiny import anchor_for, tiny_llama

needs("peft", "datasets")  # Axolotl's plugin and config code import both
pytest.importorskip("axolotl.integrations.base", reason="needs axolotl (scripts/setup.sh dev,trl,peft installs it)")

from axolotl.integrations.base import BasePlugin, PluginManager, load_plugin  # noqa: E402
from axolotl.utils.config import validate_config  # noqa: E402
from axolotl.utils.dict import DictDefault  # noqa: E402

from hf_cfp import CFPCallback  # noqa: E402
from hf_cfp.errors import CFPArgumentError  # noqa: E402
from hf_cfp.launch.axolotl import CFPPlugin  # noqa: E402

PLUGIN = "hf_cfp.launch.axolotl.CFPPlugin"


@pytest.fixture
def axolotl_config(tmp_path):
    """An Axolotl config (its own keys: model, dataset, batch) with the plugin and two anchors by directory."""
    model = tiny_llama()
    for seed, name in enumerate(("math", "code")):
        anchor_for(model, name=name, seed=seed).save_pretrained(tmp_path / name)
    PluginManager.get_instance().register(PLUGIN)
    return {
        "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct",  # a name only: nothing is loaded
        "datasets": [{"path": "hf_cfp/loading/data/pirate_style.jsonl", "type": "alpaca"}],
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 1,
        "learning_rate": 1e-4,
        "num_epochs": 1,
        "output_dir": str(tmp_path / "out"),
        "plugins": [PLUGIN],
        "cfp_anchor": str(tmp_path / "math"),
        "cfp_monitor": [str(tmp_path / "code")],
        "cfp_lam": 7.5,
        "cfp_free_fraction": 0.9,
    }


def test_axolotl_loads_the_plugin_by_its_dotted_name():
    plugin = load_plugin(PLUGIN)
    assert isinstance(plugin, CFPPlugin) and isinstance(plugin, BasePlugin)


def test_the_validated_config_gives_the_trainer_the_callback_it_describes(axolotl_config):
    validated = validate_config(DictDefault(axolotl_config))
    assert validated.cfp_lam == 7.5 and validated.cfp_free_fraction == 0.9
    (callback,) = PluginManager.get_instance().add_callbacks_pre_trainer(validated, tiny_llama())
    assert isinstance(callback, CFPCallback)
    assert [a.name for a in callback.anchors] == ["math"] and [m.name for m in callback.monitors] == ["code"]
    assert callback.settings.strength.lam == (7.5,) and callback.settings.free_fraction == 0.9


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("cfp_lam", -1, "cfp_lam must be finite and >= 0"),
        ("cfp_free_fraction", 1.5, "cfp_free_fraction must be in (0, 1)"),
        ("cfp_anchor", "./no/such/anchor", "cfp_anchor: no anchor directory at './no/such/anchor'"),
    ],
)
def test_axolotl_config_validation_refuses_a_bad_key_naming_it(axolotl_config, key, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_config(DictDefault({**axolotl_config, key: value}))


def test_the_plugin_without_an_anchor_says_what_to_add(axolotl_config):
    del axolotl_config["cfp_anchor"]
    validated = validate_config(DictDefault(axolotl_config))  # no cfp_anchor: nothing to check yet
    with pytest.raises(CFPArgumentError, match="CFPPlugin is in the Axolotl config's plugins but cfp_anchor"):
        CFPPlugin().add_callbacks_pre_trainer(validated, tiny_llama())
