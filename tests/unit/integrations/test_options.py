"""One declaration of every protection option: CFPCallback's keyword arguments, the loop API's (CFP) and CFPConfig's
`cfp_` keys are one set with one default each, apart from the options stated below as one surface's; each surface's
signature, written out in the source for type checkers, is the declared one (names, kinds, types, defaults), and a
call that does not fit it is refused; the docstrings that `help()` and the API docs show list every argument with
its type, default and declared help."""

import dataclasses
import inspect
import pydoc
import re
import typing

import pytest
import torch
from support.tiny import anchor_for, tiny_llama

from hf_cfp import CFP, CFPCallback
from hf_cfp.errors import CFPArgumentError
from hf_cfp.integrations.options import (
    CALLBACK,
    CONFIG,
    EVERYWHERE,
    LOOP,
    ProtectionOptions,
    options_on,
    signature_of,
)
from hf_cfp.launch import CFPConfig
from hf_cfp.launch.config import key_help, key_of

# What not every surface takes, and why: a Trainer's callback finds the anchors, the checkpoints and the prompts to
# re-estimate from; a loop of one's own passes its optimizer and, resuming, its theta0; a dict of estimate_fisher
# arguments has no YAML key.
CALLBACK_AND_KEYS_ONLY = {
    "strict",
    "restart_path_on_resume",
    "compute_if_missing",
    "push_if_computed",
    "recheck_every",
    "recheck_prompts",
    "refresh_fisher",
}
CALLBACK_ONLY = {"estimate_kwargs"}
LOOP_ONLY = {"optimizer", "theta0"}

# The public defaults users rely on (DESIGN.md's API); new options need only agree across the surfaces
DEFAULTS = {
    "lam": None,
    "predicted_kl_budget": None,
    "scale_lam_with_lr": False,
    "monitor": (),
    "free_fraction": 0.99,
    "fisher_dtype": "float32",
    "sparse": None,
    "sparse_by": "coordinates",
    "lora_rule": "proximal_b",
    "strict": True,
    "restart_path_on_resume": False,
    "compute_if_missing": None,
    "push_if_computed": False,
    "estimate_kwargs": None,
    "recheck_every": None,
    "recheck_prompts": None,
    "refresh_fisher": False,
    "optimizer": None,
    "theta0": None,
}


def parameters(cls) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(cls).parameters)


def config_keys() -> dict[str, dataclasses.Field]:
    fields = {f.name: f for f in dataclasses.fields(CFPConfig)}
    assert all(key.startswith("cfp_") for key in fields), list(fields)
    return {key.removeprefix("cfp_"): f for key, f in fields.items()}


def test_the_callback_the_loop_and_the_cfp_keys_take_one_set_of_options():
    callback, keys = parameters(CFPCallback), config_keys()
    loop = parameters(CFP)
    assert list(loop)[0] == "model"  # what the loop protects, then its options
    del loop["model"]
    shared = set(callback) & set(loop) & set(keys)
    assert set(callback) == shared | CALLBACK_AND_KEYS_ONLY | CALLBACK_ONLY
    assert set(loop) == shared | LOOP_ONLY
    assert set(keys) == shared | CALLBACK_AND_KEYS_ONLY
    assert shared >= {"anchor", *DEFAULTS} - CALLBACK_AND_KEYS_ONLY - CALLBACK_ONLY - LOOP_ONLY
    declared = {f.name: f.metadata["on"] for f in dataclasses.fields(ProtectionOptions)}
    assert {name for name, on in declared.items() if on == EVERYWHERE} == shared
    assert {name for name, on in declared.items() if on == {CALLBACK, CONFIG}} == CALLBACK_AND_KEYS_ONLY
    assert {name for name, on in declared.items() if on == {CALLBACK}} == CALLBACK_ONLY
    assert {name for name, on in declared.items() if on == {LOOP}} == LOOP_ONLY


def test_every_option_has_one_default_on_every_surface():
    callback, loop = parameters(CFPCallback), parameters(CFP)
    assert callback["anchor"].default is inspect.Parameter.empty and loop["anchor"].default is inspect.Parameter.empty
    for name in set(callback) & set(loop) - {"anchor"}:
        assert callback[name].default == loop[name].default, name
    for name, default in DEFAULTS.items():
        surface = callback if name in callback else loop
        assert surface[name].default == default and type(surface[name].default) is type(default), name
    # a cfp_ key left out gives the option the callback's default
    anchor = anchor_for(tiny_llama())
    given = CFPConfig(cfp_anchor="org/base:cfp/math").protection_options()
    unset = {name for name in config_keys() if name != "anchor"}
    assert {name: getattr(given, name) for name in unset} == {name: callback[name].default for name in unset}
    built = CFPCallback(anchor).options
    assert {name: getattr(built, name) for name in set(callback) - {"anchor"}} == {
        name: p.default for name, p in callback.items() if name != "anchor"
    }


def test_only_anchor_and_lam_go_by_position_and_each_surface_refuses_the_others_options():
    model = tiny_llama()
    anchor = anchor_for(model)
    assert CFPCallback(anchor, 3.0).settings.strength.lam == (3.0,)
    assert CFP(model, anchor, 3.0).settings.strength.lam == (3.0,)
    assert [n for n, p in parameters(CFPCallback).items() if p.kind is not inspect.Parameter.KEYWORD_ONLY] == [
        "anchor",
        "lam",
    ]
    with pytest.raises(TypeError, match=r"CFPCallback.__init__\(\) takes from 2 to 3 positional arguments but 4"):
        CFPCallback(anchor, 3.0, ())  # monitor by position: it would have been silently something else
    with pytest.raises(TypeError, match=r"CFPCallback.__init__\(\) got an unexpected keyword argument 'optimizer'"):
        CFPCallback(anchor, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))  # an option of CFP only
    with pytest.raises(TypeError, match=r"CFP.__init__\(\) got an unexpected keyword argument 'strict'"):
        CFP(model, anchor, strict=False)  # an option of CFPCallback and CFPConfig only
    with pytest.raises(TypeError, match=r"CFPCallback.__init__\(\) got an unexpected keyword argument 'lamb'"):
        CFPCallback(anchor, lamb=1.0)
    with pytest.raises(TypeError, match=r"CFP.__init__\(\) missing 1 required positional argument: 'anchor'"):
        CFP(model)


@pytest.mark.parametrize(("cls", "surface", "leading"), [(CFPCallback, CALLBACK, []), (CFP, LOOP, ["model"])])
def test_the_written_signature_is_the_declared_one(cls, surface, leading):
    """Adding, renaming or retyping an option in one place and not the other fails here: the parameters after the
    leading ones are the declaration's for the surface, with the same kind, annotation and default."""
    written = list(inspect.signature(cls).parameters.values())
    assert [p.name for p in written[: len(leading)]] == leading
    declared = list(signature_of(surface).parameters.values())
    assert [p.name for p in written[len(leading) :]] == [p.name for p in declared]
    for parameter, option in zip(written[len(leading) :], declared, strict=True):
        assert parameter == option, (parameter, option)  # name, kind, annotation and default
        assert type(parameter.default) is type(option.default), parameter.name


def test_the_cfp_keys_are_the_declared_options_in_their_forms():
    """CFPConfig's fields, written out in the source: one per option it takes, in the declaration's order, each
    typed and defaulted as its form holds the option (what TRL's parser reads), with the declared help. The types
    are read from the class's annotations: transformers' HfArgumentParser rewrites an Optional field's `Field.type`
    in place when it parses the class (the train command's tests do), the annotations stay as written."""
    keys, declared = dataclasses.fields(CFPConfig), options_on(CONFIG)
    annotations = typing.get_type_hints(CFPConfig)
    assert [(f.name, annotations[f.name], f.default) for f in keys] == [key_of(option) for option in declared]
    for key, option in zip(keys, declared, strict=True):
        assert type(key.default) is type(key_of(option)[2]), key.name
        assert key.metadata["help"] == key_help(option).replace("%", "%%"), key.name


@pytest.mark.parametrize(("cls", "surface"), [(CFPCallback, CALLBACK), (CFP, LOOP), (CFPConfig, CONFIG)])
def test_the_docstrings_entries_are_written_from_the_declaration(cls, surface):
    text = "".join(cls.__doc__.split())  # wrapped at any width
    for option in options_on(surface):
        if cls is CFPConfig:
            name, description = key_of(option)[0], key_help(option)
        else:
            name, description = option.name, option.metadata["help"]
        assert f"\n        {name} (" in cls.__doc__ and "".join(description.split()) in text, name


def test_each_keyword_reaches_the_options_and_the_callbacks_loop_gets_the_shared_ones():
    model = tiny_llama()
    anchor, monitor = anchor_for(model), anchor_for(model, "code", seed=1)
    callback = CFPCallback(
        anchor, lam=2.0, monitor=[monitor], free_fraction=0.5, fisher_dtype="bfloat16", lora_rule="factor_space"
    )
    options = callback.options
    assert (options.lam, options.free_fraction, options.fisher_dtype) == (2.0, 0.5, "bfloat16")
    assert options.lora_rule == "factor_space" and list(options.monitor) == [monitor]
    callback.on_train_begin(None, *_trainer_state(), model=model)
    bound = callback.cfp.settings  # the loop API's, bound with the callback's options
    assert (bound.strength, bound.memory, bound.free_fraction) == (
        callback.settings.strength,
        callback.settings.memory,
        0.5,
    )
    assert bound.lora_rule == "factor_space" and callback.cfp.anchors == [anchor] and bound.monitors == (monitor,)


def test_the_options_are_validated_once_and_name_the_option_as_the_surface_does():
    anchor = anchor_for(tiny_llama())
    with pytest.raises(CFPArgumentError, match=r"^free_fraction must be in \(0, 1\)"):
        CFPCallback(anchor, free_fraction=1.0)
    with pytest.raises(CFPArgumentError, match=r"^cfp_free_fraction must be in \(0, 1\)"):
        CFPConfig(cfp_anchor="org/base:cfp/math", cfp_free_fraction=1.0)
    with pytest.raises(CFPArgumentError, match=r"^anchor is required"):
        CFPCallback([])
    with pytest.raises(CFPArgumentError, match=r"^push_if_computed needs compute_if_missing"):
        CFPCallback(anchor, push_if_computed=True)


ENTRY = re.compile(r"^ {8}(\w+) \((.+)\):$")


def documented(cls) -> dict[str, str]:
    """name -> the type-and-default text of each entry in the docstring's `Args:` section."""
    section = cls.__doc__.split("    Args:\n", 1)[1].split("\n\n", 1)[0]
    return {m.group(1): m.group(2) for line in section.splitlines() if (m := ENTRY.match(line))}


def shown(default) -> str:
    return f'"{default}"' if isinstance(default, str) else repr(default)


@pytest.mark.parametrize("cls", [CFPCallback, CFP, CFPConfig], ids=lambda c: c.__name__)
def test_the_docstring_lists_every_argument_with_its_type_and_default(cls):
    if cls is CFPConfig:
        arguments = {f.name: f.default for f in dataclasses.fields(cls)}
    else:
        arguments = {name: p.default for name, p in parameters(cls).items()}
    entries = documented(cls)
    assert list(entries) == list(arguments)
    declared = {f.name: f for f in dataclasses.fields(ProtectionOptions)}
    for name, default in arguments.items():
        entry, option = entries[name], declared.get(name.removeprefix("cfp_"))
        required = default is inspect.Parameter.empty or (option is not None and option.name == "anchor")
        assert ("*optional*" in entry) is not required, (name, entry)
        assert ("defaults to" in entry) is (not required and default is not None), (name, entry)
        if not required and default is not None:
            assert entry.endswith(f", defaults to `{shown(default)}`"), (name, entry)
        if option is not None and cls is not CFPConfig:
            plain = [t for t in typing.get_args(option.type) or (option.type,) if t is not type(None)]
            assert entry.startswith(option.metadata["shown_type"] or f"`{plain[0].__name__}`"), (name, entry)


def test_the_config_docstring_says_which_key_is_required_and_how_each_form_is_written():
    text = " ".join(CFPConfig.__doc__.split())
    assert documented(CFPConfig)["cfp_anchor"] == "`str` or `list[str]`"
    assert documented(CFPConfig)["cfp_lam"] == "`float` or `list[float]`, *optional*"
    assert documented(CFPConfig)["cfp_recheck_prompts"] == "`str`, *optional*"
    assert "(revision and subfolder optional). From YAML or the command line: directories" in text
    assert "or absolute) or Hub references `org/model[@revision][:subfolder]`. Required. cfp_lam (" in text


def test_help_shows_the_declared_signature():
    signature = inspect.signature(CFPCallback)
    declared = {f.name: f for f in dataclasses.fields(ProtectionOptions)}
    for name, parameter in signature.parameters.items():
        assert parameter.annotation == declared[name].type, name
    assert "sparse_by: str = 'coordinates'" in pydoc.render_doc(CFPCallback)
    assert "free_fraction (`float`, *optional*, defaults to `0.99`):" in pydoc.render_doc(CFP)


def _trainer_state():
    from transformers import TrainerControl, TrainerState

    return TrainerState(), TrainerControl()
