"""Which strings are local paths and which are Hub references, and what a failed lookup says.

A mistyped relative path must fail locally: the real huggingface_hub client points at a local hub server
(tests/support/hub_server.py), whose request log must stay empty, and `snapshot_download` fails the test
if it is called at all.
"""

import pytest
from support.hub_server import hub_offline_mode
from support.tiny import anchor_for, tiny_llama

from hf_cfp import CFPCallback, FisherAnchor
from hf_cfp.anchor import hub
from hf_cfp.anchor.hub import looks_like_local_path
from hf_cfp.errors import AnchorNotFoundError


@pytest.fixture
def no_hub_calls(local_hub, monkeypatch):
    """The local hub, with `snapshot_download` replaced by a function that fails the test when called."""

    def forbidden(*args, **kwargs):
        pytest.fail(f"the Hub was asked for {args} {kwargs}")

    monkeypatch.setattr(hub, "snapshot_download", forbidden)
    return local_hub


@pytest.mark.parametrize(
    ("reference", "local"),
    [
        ("./anchors/math", True),
        ("../anchors/math", True),
        (".hidden", True),
        ("~/anchors/math", True),
        ("/abs/anchors/math", True),
        ("anchors\\math", True),
        ("anchors/maths", True),  # `anchors/` exists in the working directory
        ("math.json", True),
        ("org/anchor.safetensors", True),
        ("org/model", False),  # `org/` does not exist locally
        ("Qwen/Qwen2.5-0.5B", False),  # a dotted version is no file extension
        ("anchors/maths@main", False),  # an explicit revision makes it a Hub reference
        ("anchors:cfp/math", False),
        ("org/model.json@main", False),
    ],
)
def test_which_strings_look_like_local_paths(tmp_path, monkeypatch, reference, local):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "anchors").mkdir()
    assert looks_like_local_path(reference) is local


@pytest.mark.parametrize("reference", ["anchors/maths", "./maths", "../maths", "maths.json"])
def test_a_mistyped_relative_path_fails_locally_without_a_request(no_hub_calls, tmp_path, monkeypatch, reference):
    monkeypatch.chdir(tmp_path)
    anchor_for(tiny_llama()).save_pretrained(tmp_path / "anchors" / "math")
    for load in (FisherAnchor.from_pretrained, CFPCallback):
        with pytest.raises(AnchorNotFoundError) as caught:
            load(reference)
        message = str(caught.value)
        assert "no such local folder exists" in message
        assert message.index("no such local folder") < message.index("Hub")  # the Hub only comes after
    assert no_hub_calls.requests == []


def test_an_existing_local_path_is_read_locally(no_hub_calls, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    anchor_for(tiny_llama()).save_pretrained(tmp_path / "org" / "model")
    assert FisherAnchor.from_pretrained("org/model").name == "math"  # `org/model` could be a repo id: it exists
    (tmp_path / "file").write_text("")
    with pytest.raises(AnchorNotFoundError, match="it is a file"):
        FisherAnchor.from_pretrained("file")
    assert no_hub_calls.requests == []


def test_a_failed_hub_lookup_says_what_was_tried_and_what_to_run(local_hub, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(AnchorNotFoundError) as caught:
        FisherAnchor.from_pretrained("org/missing@v2:cfp/math", cache_dir=tmp_path / "cache")
    message = str(caught.value)
    assert message.startswith("No local folder 'org/missing@v2:cfp/math' exists.")
    for part in (
        "Hub repo 'org/missing' not found",
        "repo 'org/missing', revision 'v2', folder 'cfp/math'",
        "offline mode was off",
        "`HF_HUB_OFFLINE=0 hf-cfp pull org/missing@v2:cfp/math`",
        "`hf auth login`",
    ):
        assert part in message
    assert "/api/models/org/missing/revision/v2" in [r.raw_path for r in local_hub.requests]

    local_hub.requests.clear()
    with hub_offline_mode(True), pytest.raises(AnchorNotFoundError) as caught:
        FisherAnchor.from_pretrained("org/missing", cache_dir=tmp_path / "cache")
    message = str(caught.value)
    assert "offline and not cached" in message and "offline mode was on (HF_HUB_OFFLINE=1)" in message
    assert "revision 'main', folder '.'" in message
    assert local_hub.requests == []  # offline: the cache only
