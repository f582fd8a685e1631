"""CFPConfig: every cfp_* field reaches the CFPCallback it builds, YAML and command line are read as TRL reads them
(the command line wins), and each bad value is an error that names its field, raised when the config is built."""

import pytest
from support.anchors import same_anchor
from support.extras import needs
from support.tiny import anchor_for, tiny_llama

from hf_cfp import FisherAnchor
from hf_cfp.errors import CFPArgumentError
from hf_cfp.integrations.resolve import PendingAnchor
from hf_cfp.launch import CFPConfig
from hf_cfp.launch.config import CONFIG_KEYS
from hf_cfp.loading.prompts import calibration_prompts


@pytest.fixture
def anchors(tmp_path):
    """Directories of three anchors over a tiny Llama: math, code and safety."""
    model = tiny_llama()
    paths = {}
    for seed, name in enumerate(("math", "code", "safety")):
        anchor_for(model, name=name, seed=seed).save_pretrained(tmp_path / name)
        paths[name] = str(tmp_path / name)
    return paths


def test_every_field_reaches_the_callback(anchors):
    callback = CFPConfig(
        cfp_anchor=[anchors["math"], anchors["code"]],
        cfp_lam=[1.0, 10.0],
        cfp_scale_lam_with_lr=True,
        cfp_monitor=[anchors["safety"]],
        cfp_free_fraction=0.95,
        cfp_fisher_dtype="bfloat16",
        cfp_sparse=0.1,
        cfp_sparse_by="mass",
        cfp_lora_rule="factor_space",
        cfp_strict=False,
        cfp_restart_path_on_resume=True,
    ).build_callback()
    loaded = (*callback.anchors, *callback.monitors)
    assert [a.name for a in loaded] == ["math", "code", "safety"]
    for anchor, name in zip(loaded, ("math", "code", "safety"), strict=True):
        assert same_anchor(anchor, FisherAnchor.from_pretrained(anchors[name]))
    assert callback.settings.strength.lam == (1.0, 10.0) and callback.settings.strength.scale_with_lr
    assert callback.settings.strength.predicted_kl_budget is None
    memory = callback.settings.memory
    assert (memory.fisher_dtype, memory.sparse, memory.sparse_by) == ("bfloat16", 0.1, "mass")
    assert callback.settings.free_fraction == 0.95 and callback.settings.lora_rule == "factor_space"
    assert callback.strict is False and callback.restart_path_on_resume is True
    assert callback.recheck.every is None


def test_one_value_stands_for_every_anchor_and_a_budget_replaces_lam(anchors):
    config = CFPConfig(cfp_anchor=[anchors["math"], anchors["code"]], cfp_lam=4)  # YAML gives a scalar
    assert config.cfp_lam == [4] and config.build_callback().settings.strength.lam == (4.0, 4.0)
    budget = CFPConfig(cfp_anchor=anchors["math"], cfp_predicted_kl_budget=0.05).build_callback().settings.strength
    assert budget.predicted_kl_budget == (0.05,) and budget.lam == ()
    default = CFPConfig(cfp_anchor=anchors["math"]).build_callback().settings.strength
    assert default.lam == (1.0,)  # the callback's default


def test_recheck_reads_its_prompt_source(anchors):
    recheck = CFPConfig(cfp_anchor=anchors["math"], cfp_recheck_every=5, cfp_recheck_prompts="math").build_callback()
    assert recheck.recheck.every == 5 and recheck.recheck.prompts == {"math": calibration_prompts("math")}
    assert recheck.recheck.refresh is False


def test_a_measured_budget_reads_its_prompt_source(anchors):
    callback = CFPConfig(
        cfp_anchor=anchors["math"], cfp_kl_budget=0.2, cfp_kl_prompts="math", cfp_kl_every=5, cfp_lam=3.0
    ).build_callback()
    strength, measurement = callback.settings.strength, callback.settings.kl_measurement
    assert strength.kl_budget == (0.2,) and strength.start == (3.0,)
    assert measurement.every == 5 and measurement.prompts == {"math": calibration_prompts("math")}


def test_yaml_then_command_line_as_trl_reads_them(anchors, tmp_path):
    needs("trl")
    from trl import TrlParser

    config = tmp_path / "cfg.yaml"
    config.write_text(
        f"cfp_anchor: [{anchors['math']}, {anchors['code']}]\ncfp_lam: 1.0\ncfp_free_fraction: 0.9\n"
        f"cfp_monitor: {anchors['safety']}\ncfp_fisher_dtype: bfloat16\n"
    )
    parser = TrlParser([CFPConfig])
    (parsed,) = parser.parse_args_and_config(["--config", str(config), "--cfp_lam", "4", "5", "--no_cfp_strict"])
    assert parsed.cfp_anchor == [anchors["math"], anchors["code"]] and parsed.cfp_monitor == [anchors["safety"]]
    assert parsed.cfp_lam == [4.0, 5.0]  # the command line wins
    assert (parsed.cfp_free_fraction, parsed.cfp_fisher_dtype, parsed.cfp_strict) == (0.9, "bfloat16", False)
    (plain,) = parser.parse_args_and_config(["--config", str(config)])
    assert plain.cfp_lam == [1.0] and plain.cfp_strict is True


BAD = [
    ({}, "cfp_anchor is required"),
    ({"cfp_anchor": "./missing/anchor"}, "cfp_anchor: no anchor directory at './missing/anchor'"),
    ({"cfp_anchor": "not a reference!"}, "cfp_anchor: 'not a reference!' is neither an anchor directory"),
    ({"cfp_monitor": ["/no/such/dir"]}, "cfp_monitor: no anchor directory at '/no/such/dir'"),
    ({"cfp_lam": [-1.0]}, "cfp_lam must be finite and >= 0"),
    ({"cfp_lam": [1.0, 2.0]}, "cfp_lam must be a number or a sequence of 1 numbers"),
    ({"cfp_predicted_kl_budget": [0.0]}, "cfp_predicted_kl_budget must be finite and > 0"),
    ({"cfp_predicted_kl_budget": [0.1], "cfp_scale_lam_with_lr": True}, "cfp_scale_lam_with_lr applies to cfp_lam"),
    ({"cfp_kl_budget": [0.1]}, "cfp_kl_budget needs cfp_kl_prompts"),
    ({"cfp_kl_budget": [0.1], "cfp_kl_prompts": "math", "cfp_kl_every": 0}, "cfp_kl_every must be an integer >= 1"),
    ({"cfp_free_fraction": 1.0}, "cfp_free_fraction must be in (0, 1), got 1.0"),
    ({"cfp_fisher_dtype": "float16"}, "cfp_fisher_dtype must be one of ['bfloat16', 'float32'], got 'float16'"),
    ({"cfp_sparse": 1.5}, "cfp_sparse must be None (dense) or a share in (0, 1)"),
    ({"cfp_sparse": 0.1, "cfp_sparse_by": "rows"}, "cfp_sparse_by must be one of"),
    ({"cfp_lora_rule": "exact"}, "cfp_lora_rule must be one of"),
    ({"cfp_recheck_every": 0, "cfp_recheck_prompts": "math"}, "cfp_recheck_every must be an integer >= 1"),
    ({"cfp_recheck_prompts": "math"}, "cfp_recheck_prompts and cfp_refresh_fisher need cfp_recheck_every"),
    ({"cfp_recheck_every": 2, "cfp_recheck_prompts": "algebra"}, "cfp_recheck_prompts: cannot read prompts"),
    ({"cfp_compute_if_missing": "no/such/prompts.jsonl"}, "cfp_compute_if_missing: cannot read prompts"),
    ({"cfp_push_if_computed": True}, "cfp_push_if_computed needs cfp_compute_if_missing"),
]


def test_compute_if_missing_with_two_anchors_is_named_when_the_config_is_built(anchors):
    """The callback's own rule (it estimates one anchor), checked with the keys' names before any anchor loads."""
    with pytest.raises(CFPArgumentError, match="cfp_compute_if_missing estimates one anchor"):
        CFPConfig(cfp_anchor=[anchors["math"], anchors["code"]], cfp_compute_if_missing="math")


def test_what_shows_only_with_the_anchors_is_refused_when_the_callback_is_built(anchors, tmp_path):
    """Two directories holding anchors of one name: the references differ, the loaded names do not."""
    anchor_for(tiny_llama(), name="math", seed=5).save_pretrained(tmp_path / "other")
    config = CFPConfig(cfp_anchor=anchors["math"], cfp_monitor=[str(tmp_path / "other")])
    with pytest.raises(CFPArgumentError, match=r"Anchor names must be unique .*\['math', 'math'\]"):
        config.build_callback()


@pytest.mark.parametrize(("fields", "message"), BAD, ids=[message.split(" ")[0] for _, message in BAD])
def test_a_bad_value_names_its_field(fields, message, anchors):
    if "cfp_anchor" not in fields and fields:
        fields = {"cfp_anchor": anchors["math"], **fields}
    with pytest.raises(CFPArgumentError) as caught:
        CFPConfig(**fields)
    assert message in str(caught.value)


def test_a_hub_reference_is_loaded_when_the_callback_is_built_or_computed_if_missing(local_hub, tmp_path):
    anchor = anchor_for(tiny_llama(), name="math", seed=3)
    anchor.push_to_hub("org/base", path_in_repo="cfp/math")
    config = CFPConfig(cfp_anchor="org/base:cfp/math", cfp_lam=2.0)  # checked by form only: no download yet
    loaded = config.build_callback().anchor
    assert same_anchor(loaded, anchor) and loaded.metadata["hub"]["repo_id"] == "org/base"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("two plus three\nwhat is five\n")
    pending = CFPConfig(cfp_anchor="org/base:cfp/code", cfp_compute_if_missing=str(prompts)).build_callback().anchor
    assert isinstance(pending, PendingAnchor) and pending.prompts == ["two plus three", "what is five"]


def test_the_train_commands_help_lists_every_cfp_key_with_the_declared_help():
    needs("trl")
    from hf_cfp.launch.train import make_parser

    text = " ".join(make_parser("dpo").format_help().split())  # argparse formats help with %: escaped once
    for key in CONFIG_KEYS:
        assert f"--{key}" in text, key
    assert "the share of its top-1% coordinates still in the top 1%" in text
    assert "Share of coordinates, by smallest F, that `free_drift` runs over; in (0, 1). (default: 0.99)" in text
