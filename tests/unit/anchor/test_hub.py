"""Anchors on the Hub, with the real huggingface_hub client against a local server (tests/support/hub_server.py)."""

import pytest
import torch
from huggingface_hub import ModelCard
from support.anchors import same_anchor
from support.hub_server import hub_offline_mode, no_backoff_sleep
from support.tiny import anchor_for, tiny_llama

from hf_cfp import FisherAnchor
from hf_cfp.errors import AnchorFormatError, AnchorNotFoundError, AnchorValidationError, CFPHubError


def test_push_to_an_anchors_repo_and_pull_it_back(local_hub, tmp_path):
    anchor = anchor_for(tiny_llama())
    info = anchor.push_to_hub("org/anchors")
    files = local_hub.files("org/anchors")
    assert {"cfp/math/fisher.safetensors", "cfp/math/cfp_config.json", "cfp/math/README.md"} <= set(files)
    assert len(local_hub.history("org/anchors")) == 2  # the repo's first commit, then exactly one push
    card = ModelCard(files["cfp/math/README.md"].decode())
    assert card.data.base_model == "org/base" and {"cfp", "fisher-anchor"} <= set(card.data.tags)
    assert "Diagonal only" in card.text and "org/anchors:cfp/math" in card.text

    pulled = FisherAnchor.from_pretrained("org/anchors", subfolder="cfp/math", cache_dir=tmp_path)
    assert same_anchor(pulled, anchor)
    assert pulled.metadata["hub"] == {
        "repo_id": "org/anchors",
        "subfolder": "cfp/math",
        "revision": "main",
        "commit": local_hub.resolve("org/anchors", "main"),
    }
    assert info.oid == local_hub.resolve("org/anchors", "main")


def test_push_into_the_base_model_repo_as_a_pull_request(local_hub, tmp_path):
    local_hub.create_repo("org/base")
    local_hub.commit("org/base", {"config.json": "{}", "README.md": "# the base model"})
    main_before = local_hub.files("org/base")
    anchor = anchor_for(tiny_llama())
    info = anchor.push_to_hub("org/base", path_in_repo="cfp/math", create_pr=True)
    assert local_hub.files("org/base") == main_before  # main untouched, its README kept
    assert "cfp/math/fisher.safetensors" in local_hub.files("org/base", "refs/pr/1")
    assert info.pr_num == 1
    assert same_anchor(FisherAnchor.from_pretrained("org/base@refs/pr/1:cfp/math", cache_dir=tmp_path), anchor)
    with pytest.raises(AnchorNotFoundError, match="no anchor at 'cfp/math'"):
        FisherAnchor.from_pretrained("org/base:cfp/math", cache_dir=tmp_path)  # not on main


def test_pull_pins_branches_and_commits(local_hub, tmp_path):
    model = tiny_llama()
    first, second = anchor_for(model, seed=1), anchor_for(model, seed=2)
    first.push_to_hub("org/anchors")
    sha = local_hub.resolve("org/anchors", "main")
    second.push_to_hub("org/anchors")
    assert same_anchor(FisherAnchor.from_pretrained("org/anchors", subfolder="cfp/math", cache_dir=tmp_path), second)
    old = FisherAnchor.from_pretrained("org/anchors", subfolder="cfp/math", revision=sha, cache_dir=tmp_path)
    assert same_anchor(old, first) and old.metadata["hub"]["commit"] == sha


def test_offline_reuse_from_the_cache(local_hub, tmp_path):
    anchor_for(tiny_llama()).push_to_hub("org/anchors")
    online = FisherAnchor.from_pretrained("org/anchors:cfp/math", cache_dir=tmp_path)
    local_hub.stop()
    assert same_anchor(
        FisherAnchor.from_pretrained("org/anchors:cfp/math", cache_dir=tmp_path, local_files_only=True), online
    )
    with hub_offline_mode(True):
        assert same_anchor(FisherAnchor.from_pretrained("org/anchors:cfp/math", cache_dir=tmp_path), online)
        with pytest.raises(AnchorNotFoundError, match="offline and not cached"):
            FisherAnchor.from_pretrained("org/other:cfp/math", cache_dir=tmp_path)


def test_sharded_bfloat16_round_trip_through_the_hub(local_hub, tmp_path):
    anchor = anchor_for(tiny_llama())
    anchor.push_to_hub("org/anchors", max_shard_size="8KB", dtype="bfloat16")
    shards = [f for f in local_hub.files("org/anchors") if f.startswith("cfp/math/fisher-")]
    assert len(shards) > 1 and "cfp/math/fisher.safetensors.index.json" in local_hub.files("org/anchors")
    pulled = FisherAnchor.from_pretrained("org/anchors:cfp/math", cache_dir=tmp_path)
    assert all(torch.equal(pulled.fisher[n], t.bfloat16().float()) for n, t in anchor.fisher.items())
    anchor.push_to_hub("org/anchors")  # re-pushed as one file: the old shards go in the same commit
    assert not [f for f in local_hub.files("org/anchors") if f.startswith("cfp/math/fisher-")]
    assert same_anchor(FisherAnchor.from_pretrained("org/anchors:cfp/math", cache_dir=tmp_path / "2"), anchor)


def test_hub_errors_become_clear_library_errors(local_hub, tmp_path):
    with pytest.raises(AnchorNotFoundError, match="Hub repo 'org/missing' not found"):
        FisherAnchor.from_pretrained("org/missing:cfp/math", cache_dir=tmp_path)
    anchor_for(tiny_llama()).push_to_hub("org/anchors")
    with pytest.raises(AnchorNotFoundError, match="Revision 'v9' not found"):
        FisherAnchor.from_pretrained("org/anchors@v9:cfp/math", cache_dir=tmp_path)
    with pytest.raises(AnchorNotFoundError, match="no anchor at 'cfp/code'"):
        FisherAnchor.from_pretrained("org/anchors:cfp/code", cache_dir=tmp_path)

    before = local_hub.resolve("org/anchors", "main")
    local_hub.fail_always("/commit/", status=500)
    with no_backoff_sleep(), pytest.raises(CFPHubError, match="remote was not changed"):
        anchor_for(tiny_llama(), seed=3).push_to_hub("org/anchors")
    assert local_hub.resolve("org/anchors", "main") == before
    local_hub.clear_failures()
    local_hub.fail_always("/resolve/", status=500)
    with no_backoff_sleep(), pytest.raises(CFPHubError, match="failed to serve"):
        FisherAnchor.from_pretrained("org/anchors:cfp/math", cache_dir=tmp_path / "fresh")


@pytest.mark.parametrize("bad", ["../x", "cfp/../../x", "/abs/path", "cfp\\math"])
def test_paths_escaping_the_repo_are_refused(local_hub, bad):
    with pytest.raises(AnchorValidationError, match="Path in repo"):
        FisherAnchor.from_pretrained("org/anchors", subfolder=bad)
    with pytest.raises(AnchorValidationError, match="Path in repo"):
        anchor_for(tiny_llama()).push_to_hub("org/anchors", path_in_repo=bad)
    assert not local_hub.repo_exists("org/anchors")  # refused before anything was sent


def test_truncated_file_on_the_hub_is_detected(local_hub, tmp_path):
    anchor = anchor_for(tiny_llama())
    anchor.save_pretrained(tmp_path / "a")
    local_hub.create_repo("org/anchors")
    local_hub.commit(
        "org/anchors",
        {
            "cfp/math/cfp_config.json": (tmp_path / "a" / "cfp_config.json").read_bytes(),
            "cfp/math/fisher.safetensors": (tmp_path / "a" / "fisher.safetensors").read_bytes()[:-64],
        },
    )
    with pytest.raises(AnchorFormatError, match="fisher.safetensors"):
        FisherAnchor.from_pretrained("org/anchors:cfp/math", cache_dir=tmp_path / "cache")
