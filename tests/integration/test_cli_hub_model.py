"""`hf-cfp estimate --model org/name[@revision]` against the local fake Hub (tests/support/hub_server.py): a tiny
Llama and its tokenizer are pushed with the real `huggingface_hub` client (two commits of different weights), and
the command's anchor must equal `estimate_fisher` run in the test on the in-memory model of the commit asked for
(bit for bit: the same weights, loaded in float32 on the CPU by default); `--dtype bfloat16` loads bf16 parameters
and equals the reference on the model with its parameters cast to bf16; the cache serves a second run offline; an
offline miss, a missing repo or revision, and a server error exit with the CLI's codes and say what to do."""

from unittest import mock

import pytest
import torch
from huggingface_hub import HfApi, constants
from support.anchors import same_anchor
from support.hub_server import hub_offline_mode, no_backoff_sleep
from support.tiny import tiny_llama, tiny_tokenizer

from hf_cfp import FisherAnchor, estimate_fisher
from hf_cfp.cli import main
from hf_cfp.loading.models import load_causal_lm
from hf_cfp.loading.prompts import load_prompts

SIZE = {"num_sequences": 4, "max_new_tokens": 4, "batch_size": 2, "seed": 0}
FLAGS = ["--prompts", "math", "--num-sequences", "4", "--max-new-tokens", "4", "--batch-size", "2"]


@pytest.fixture
def pushed(local_hub, tmp_path):
    """`org/tiny` on the local Hub: commit v1 (seed 0 weights, tagged `v1`), then main (seed 1 weights); returns
    the tokenizer and {commit: in-memory model}."""
    tokenizer, api, models = tiny_tokenizer(), HfApi(), {}
    api.create_repo("org/tiny")
    for seed in (0, 1):
        model = tiny_llama(vocab_size=len(tokenizer), seed=seed)
        folder = tmp_path / f"push-{seed}"
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        commit = api.upload_folder(folder_path=folder, repo_id="org/tiny").oid
        models[commit] = model
    first, main_commit = list(models)
    local_hub.create_tag("org/tiny", "v1", revision=first)
    assert local_hub.resolve("org/tiny") == main_commit
    return tokenizer, models


def reference(model, tokenizer):
    """The anchor `estimate_fisher` gives in this process for `model` with the command's settings."""
    return estimate_fisher(model, tokenizer, load_prompts("math"), name="math", show_progress=False, **SIZE)


def estimate(model: str, output, *extra) -> FisherAnchor:
    main(["estimate", "--model", model, "--output", str(output), *FLAGS, *extra])
    return FisherAnchor.from_pretrained(output)


def test_estimate_a_hub_model_at_main_and_at_a_revision(pushed, local_hub, tmp_path):
    tokenizer, models = pushed
    first, main_commit = list(models)
    at_main = estimate("org/tiny", tmp_path / "main")
    assert same_anchor(at_main, reference(models[main_commit], tokenizer))
    assert at_main.metadata["base_model"] == "org/tiny" and at_main.metadata["base_model_revision"] == main_commit
    for revision in ("v1", first):  # a tag, and the commit it names
        at_first = estimate(f"org/tiny@{revision}", tmp_path / revision)
        assert same_anchor(at_first, reference(models[first], tokenizer))
        assert at_first.metadata["base_model_revision"] == first
    assert not same_anchor(at_main, at_first)  # the two commits' weights give two anchors
    requests = len(local_hub.requests)
    with hub_offline_mode(True):  # the cache serves the same model without a request
        offline = estimate("org/tiny", tmp_path / "offline")
    assert same_anchor(offline, at_main) and len(local_hub.requests) == requests


def test_estimate_loads_bfloat16_with_dtype(pushed, tmp_path, monkeypatch):
    tokenizer, models = pushed
    loaded = []

    def recording_loader(*args, **kwargs):
        model, tok = load_causal_lm(*args, **kwargs)
        loaded.append({p.dtype for p in model.parameters()} | {p.device.type for p in model.parameters()})
        return model, tok

    monkeypatch.setattr("hf_cfp.cli.estimate.load_causal_lm", recording_loader)
    bf16 = estimate("org/tiny", tmp_path / "bf16", "--dtype", "bfloat16", "--device", "cpu")
    fp32 = estimate("org/tiny", tmp_path / "fp32")  # the CPU's default: float32
    assert loaded == [{torch.bfloat16, "cpu"}, {torch.float32, "cpu"}]
    model = models[list(models)[-1]]
    for parameter in model.parameters():  # the buffers (rotary inv_freq) stay float32, as from_pretrained keeps them
        parameter.data = parameter.data.to(torch.bfloat16)
    assert same_anchor(bf16, reference(model, tokenizer))
    assert not same_anchor(bf16, fp32)
    mass = [anchor.metadata["statistics"]["total_mass"] for anchor in (bf16, fp32)]
    assert mass[0] == pytest.approx(mass[1], rel=0.01)  # rounded (4e-4 here), not another quantity


def test_offline_miss_says_how_to_download(pushed, local_hub, tmp_path, capsys):
    requests = len(local_hub.requests)
    with hub_offline_mode(True), mock.patch.object(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache")):
        with pytest.raises(SystemExit) as exited:
            main(["estimate", "--model", "org/tiny@v1", "--output", str(tmp_path / "out"), *FLAGS])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and len(local_hub.requests) == requests
    assert "Hub model 'org/tiny@v1' is not in the Hugging Face cache" in err
    assert "offline mode is on (HF_HUB_OFFLINE=1)" in err
    assert "`HF_HUB_OFFLINE=0 hf download org/tiny --revision v1`" in err
    assert not (tmp_path / "out").exists()


MISSING = {
    "no such repo": ("org/absent", 2, "Hub model 'org/absent' not found (or private or gated)"),
    "no such revision": ("org/tiny@v9", 2, "Hub model 'org/tiny' has no revision 'v9'"),
}


@pytest.mark.parametrize("case", MISSING)
def test_missing_repo_or_revision_exits_2(pushed, tmp_path, capsys, case):
    model, code, message = MISSING[case]
    with pytest.raises(SystemExit) as exited:
        main(["estimate", "--model", model, "--output", str(tmp_path / "out"), *FLAGS])
    assert exited.value.code == code and message in capsys.readouterr().err


def test_server_error_exits_1(pushed, local_hub, tmp_path, capsys):
    local_hub.fail_always("config.json", 500)
    with no_backoff_sleep(), mock.patch.object(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache")):
        with pytest.raises(SystemExit) as exited:
            main(["estimate", "--model", "org/tiny", "--output", str(tmp_path / "out"), *FLAGS])
    err = capsys.readouterr().err
    assert exited.value.code == 1 and "The Hub failed to serve 'org/tiny'" in err and "Retry later" in err
