"""hf_cfp.imports: optional packages probed without importing them, and the error that names the missing extra;
the `hf-cfp` command that needs one says so before importing anything of it."""

import importlib.util
import sys

import pytest

import hf_cfp.imports as imports
from hf_cfp import CFPError
from hf_cfp.cli import main

PROBES = {
    "trl": imports.is_trl_available,
    "datasets": imports.is_datasets_available,
    "peft": imports.is_peft_available,
    "deepspeed": imports.is_deepspeed_available,
    "bitsandbytes": imports.is_bitsandbytes_available,
    "matplotlib": imports.is_matplotlib_available,
    "gguf": imports.is_gguf_available,
}


def test_every_optional_package_has_a_probe_and_an_extra():
    assert set(PROBES) == set(imports.EXTRA_OF)
    assert set(imports.EXTRA_OF.values()) <= {"trl", "peft", "qlora", "deepspeed", "demo"}  # pyproject's extras


@pytest.mark.parametrize("package", sorted(PROBES))
def test_a_probe_finds_what_find_spec_finds_and_imports_nothing(package):
    was_loaded = package in sys.modules
    assert PROBES[package]() is (importlib.util.find_spec(package) is not None)
    assert (package in sys.modules) is was_loaded  # located, not imported


def test_require_names_each_missing_package_and_the_extras_that_install_them(monkeypatch):
    monkeypatch.setattr(imports, "is_available", lambda package: package == "peft")
    imports.require("hf-cfp demo --peft", "peft")  # installed: nothing raised
    with pytest.raises(CFPError) as raised:
        imports.require("hf-cfp train", "trl", "datasets", "peft", "gguf")
    assert str(raised.value) == (
        "hf-cfp train needs trl and datasets and gguf, which are not installed: run `pip install 'hf-cfp[trl,demo]'`."
    )
    with pytest.raises(CFPError, match=r"needs bitsandbytes, which is not installed: .*'hf-cfp\[qlora\]'"):
        imports.require("QLoRA", "bitsandbytes")


def test_hf_cfp_train_without_trl_exits_1_naming_the_extra(monkeypatch, capsys):
    monkeypatch.setattr(imports, "is_available", lambda package: package not in ("trl", "datasets"))
    monkeypatch.delitem(sys.modules, "hf_cfp.cli.train", raising=False)  # so that it is not already imported
    with pytest.raises(SystemExit) as exited:
        main(["train", "sft", "--config", "unused.yaml"])
    assert exited.value.code == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0] == (
        "hf-cfp train: error: hf-cfp train needs trl and datasets, which are not installed: "
        "run `pip install 'hf-cfp[trl]'`."
    )
    assert "hf_cfp.cli.train" not in sys.modules  # refused before the command's module (and TRL) was imported
