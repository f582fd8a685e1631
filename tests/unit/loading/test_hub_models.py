"""Which `--model` strings are Hub ids (`hub_model_reference`), and the resolution of one to a commit
(`resolve_hub_model`) against the local fake Hub: a branch, a tag and a sha give the commit the hub reports, a repo
without config.json is refused by name."""

import pytest
from huggingface_hub import HfApi

from hf_cfp.errors import CFPArgumentError
from hf_cfp.loading.hub_models import hub_model_reference, resolve_hub_model

REFERENCES = {
    "Qwen/Qwen2.5-7B-Instruct": ("Qwen/Qwen2.5-7B-Instruct", None),
    "org/name@v1.0": ("org/name", "v1.0"),
    "org/name@refs/pr/3": ("org/name", "refs/pr/3"),
    "org/name@" + "a" * 40: ("org/name", "a" * 40),
    "smollm2-135m": None,  # a bare name: never a Hub id
    "./org/name": None,
    "/models/org/name": None,
    "~/org/name": None,
    "org/model.gguf": None,  # a file extension: a local path
    "org/name/extra": None,
    "org/name@": None,
}


@pytest.mark.parametrize("text", REFERENCES)
def test_hub_model_reference(text):
    assert hub_model_reference(text) == REFERENCES[text]


def test_an_existing_path_is_never_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    (tmp_path / "models").mkdir()
    assert hub_model_reference("org/name") is None  # it exists here
    assert hub_model_reference("models/missing") is None  # its first segment exists here
    assert hub_model_reference("other/name") == ("other/name", None)


def test_resolve_a_branch_a_tag_and_a_sha(local_hub):
    local_hub.create_repo("org/model")
    first = local_hub.commit("org/model", {"config.json": '{"model_type": "llama"}'})
    local_hub.create_tag("org/model", "v1")
    second = local_hub.commit("org/model", {"config.json": '{"model_type": "llama", "hidden_size": 8}'})
    assert resolve_hub_model("org/model") == second
    assert resolve_hub_model("org/model", "main") == second
    assert resolve_hub_model("org/model", "v1") == first
    assert resolve_hub_model("org/model", first) == first


def test_a_repo_without_config_is_not_a_model(local_hub):
    HfApi().create_repo("org/anchors")
    with pytest.raises(CFPArgumentError, match="'org/anchors' has no config.json: it is not a transformers model"):
        resolve_hub_model("org/anchors")
