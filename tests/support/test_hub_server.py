"""The local fake Hub (tests/support/hub_server.py) driven by the *real* huggingface_hub client, through the calls
hf_cfp makes: create_repo, list_repo_files, create_commit (adds, deletes, revision=, create_pr=True),
snapshot_download / hf_hub_download by branch, tag, refs/pr/N and sha, the errors they raise, and offline reuse."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from support.hub_server import LocalHub, hub_offline_mode, no_backoff_sleep

TOKEN = "fake-token"
REPO = "org/base-model"
PATTERNS = ["cfp/math/*"]
README = "---\ntags: [cfp]\n---\n# Anchor\n"


def _adds(files: dict, folder: str = "cfp/math") -> list[CommitOperationAdd]:
    return [
        CommitOperationAdd(f"{folder}/{name}", content if isinstance(content, bytes) else content.encode())
        for name, content in files.items()
    ]


def _read_tree(root: str) -> dict:
    root_p = Path(root)
    return {p.relative_to(root_p).as_posix(): p.read_bytes() for p in sorted(root_p.rglob("*")) if p.is_file()}


def _state(hub: LocalHub, repo_id: str = REPO) -> tuple:
    return hub.refs(repo_id), [c["oid"] for c in hub.history(repo_id)], hub.files(repo_id)


@pytest.fixture
def api(local_hub):
    return HfApi(endpoint=local_hub.endpoint, token=TOKEN)


@pytest.fixture
def populated(local_hub, api):
    """main: initial -> base model -> A (cfp/math v1) -> cfp/code -> B (cfp/math v2); refs/pr/1: C on top of B."""
    api.create_repo(REPO, exist_ok=True)
    api.create_commit(REPO, [CommitOperationAdd("model.safetensors", b"base weights")], commit_message="base model")
    a = api.create_commit(
        REPO,
        _adds({"fisher.safetensors": b"\x01" * 64, "cfp_config.json": '{"v": 1}', "README.md": README}),
        commit_message="anchor v1",
    )
    api.create_commit(REPO, _adds({"fisher.safetensors": b"\x09" * 8}, "cfp/code"), commit_message="another anchor")
    b = api.create_commit(
        REPO,
        _adds({"fisher.safetensors": b"\x02" * 64, "cfp_config.json": '{"v": 2}', "README.md": README}),
        commit_message="anchor v2",
    )
    main_before_pr = local_hub.resolve(REPO, "main")
    c = api.create_commit(
        REPO,
        _adds({"fisher.safetensors": b"\x03" * 64, "cfp_config.json": '{"v": 3}'}),
        commit_message="anchor v3 as PR",
        create_pr=True,
    )
    return {"A": a, "B": b, "C": c, "main_before_pr": main_before_pr}


def test_create_repo_exist_ok(local_hub, api):
    url = api.create_repo(REPO, private=True)
    assert url.repo_id == REPO and url.endswith(f"/{REPO}")
    assert api.create_repo(REPO, exist_ok=True).repo_id == REPO
    with pytest.raises(HfHubHTTPError) as exc:
        api.create_repo(REPO)
    assert exc.value.response.status_code == 409
    info = api.repo_info(REPO, revision="main")
    assert info.private is True and [s.rfilename for s in info.siblings] == [".gitattributes"]
    assert info.sha == local_hub.resolve(REPO) and api.list_repo_files(REPO) == [".gitattributes"]
    assert api.repo_info(api.create_repo("org/public").repo_id, revision="main").private is False


def test_commits_to_branches_and_pull_requests(local_hub, api, populated):
    a, b, c = populated["A"], populated["B"], populated["C"]
    assert a.pr_url is None and b.pr_url is None
    # the PR commit landed on refs/pr/1 only, on top of main; main is unchanged
    assert c.pr_revision == "refs/pr/1" and c.pr_num == 1
    assert local_hub.refs(REPO) == {"refs/heads/main": b.oid, "refs/pr/1": c.oid}
    assert b.oid == populated["main_before_pr"]
    assert [h["oid"] for h in local_hub.history(REPO, "refs/pr/1")[:2]] == [c.oid, b.oid]
    assert [h["title"] for h in local_hub.history(REPO)] == [
        "anchor v2",
        "another anchor",
        "anchor v1",
        "base model",
        "initial commit",
    ]
    assert local_hub.files(REPO, "main")["cfp/math/cfp_config.json"] == b'{"v": 2}'
    assert local_hub.files(REPO, "refs/pr/1")["cfp/math/cfp_config.json"] == b'{"v": 3}'
    assert sorted(api.list_repo_files(REPO, revision="refs/pr/1")) == [
        ".gitattributes",
        "cfp/code/fisher.safetensors",
        "cfp/math/README.md",
        "cfp/math/cfp_config.json",
        "cfp/math/fisher.safetensors",
        "model.safetensors",
    ]

    # unchanged files are left out (the server answers the remote oid at preupload): no empty commit
    same = api.create_commit(REPO, _adds({"cfp_config.json": '{"v": 2}', "README.md": README}), commit_message="noop")
    assert same.oid == b.oid and len(local_hub.history(REPO)) == 5

    # a second PR, and pushing more to an existing PR moves only its ref
    d = api.create_commit(REPO, _adds({"extra.txt": "x"}), commit_message="pr 2", create_pr=True)
    assert d.pr_revision == "refs/pr/2" and local_hub.resolve(REPO, "main") == b.oid
    e = api.create_commit(REPO, _adds({"more.txt": "y"}), commit_message="more", revision="refs/pr/1")
    assert local_hub.resolve(REPO, "refs/pr/1") == e.oid and "cfp/math/more.txt" in local_hub.files(REPO, "refs/pr/1")
    assert local_hub.resolve(REPO, "main") == b.oid and local_hub.resolve(REPO, "refs/pr/2") == d.oid

    # revision=branch, with deletes; and a PR against that branch
    local_hub.create_branch(REPO, "anchors")  # from main = B
    f = api.create_commit(
        REPO,
        [CommitOperationDelete("cfp/code/fisher.safetensors")],
        commit_message="drop code anchor",
        revision="anchors",
    )
    assert local_hub.resolve(REPO, "anchors") == f.oid and local_hub.resolve(REPO, "main") == b.oid
    assert not any(p.startswith("cfp/code/") for p in local_hub.files(REPO, "anchors"))
    g = api.create_commit(REPO, _adds({"x.txt": "x"}), commit_message="pr 3", revision="anchors", create_pr=True)
    assert g.pr_num == 3 and local_hub.history(REPO, "refs/pr/3")[1]["oid"] == f.oid
    assert local_hub.resolve(REPO, "anchors") == f.oid


def _offline_configs(hub: LocalHub, cache: Path, revisions: list[str]) -> dict:
    """Each revision's cfp_config.json as snapshot_download reads it with HF_HUB_OFFLINE=1 in a fresh process (the
    flag is read at import time)."""
    script = textwrap.dedent(f"""
        import json
        from huggingface_hub import snapshot_download
        out = {{}}
        for rev in {revisions!r}:
            p = snapshot_download("{REPO}", revision=rev, allow_patterns={PATTERNS!r}, cache_dir={str(cache)!r})
            out[rev] = open(p + "/cfp/math/cfp_config.json").read()
        print(json.dumps(out))
    """)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": hub.endpoint}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_downloads_by_branch_sha_tag_pr_and_offline_reuse(local_hub, api, populated, tmp_path):
    a, b, c = populated["A"], populated["B"], populated["C"]
    local_hub.create_tag(REPO, "v1", revision=a.oid)
    cache = tmp_path / "cache"
    expected = {
        "main": (b.oid, b'{"v": 2}', b"\x02" * 64),
        a.oid: (a.oid, b'{"v": 1}', b"\x01" * 64),
        "v1": (a.oid, b'{"v": 1}', b"\x01" * 64),
        "refs/pr/1": (c.oid, b'{"v": 3}', b"\x03" * 64),
    }

    def download(rev: str, **kwargs) -> str:
        return snapshot_download(
            REPO,
            revision=rev,
            allow_patterns=PATTERNS,
            cache_dir=cache,
            endpoint=local_hub.endpoint,
            token=TOKEN,
            **kwargs,
        )

    def check(path: str, rev: str) -> None:
        sha, config, tensors = expected[rev]
        assert Path(path).name == sha  # snapshot folder = resolved commit
        tree = _read_tree(path)
        assert set(tree) <= {"cfp/math/README.md", "cfp/math/cfp_config.json", "cfp/math/fisher.safetensors"}
        assert tree["cfp/math/cfp_config.json"] == config and tree["cfp/math/fisher.safetensors"] == tensors

    for rev in expected:
        check(download(rev), rev)
    # PR refs travel URL-encoded
    assert any(r.raw_path.endswith("/revision/refs%2Fpr%2F1") for r in local_hub.requests)
    one = hf_hub_download(
        REPO,
        "cfp/math/cfp_config.json",
        revision="refs/pr/1",
        cache_dir=cache,
        endpoint=local_hub.endpoint,
        token=TOKEN,
    )
    assert Path(one).read_bytes() == b'{"v": 3}'

    # --- the Hub goes away: everything is served from the cache
    local_hub.stop()
    for rev in expected:
        check(download(rev, local_files_only=True), rev)
    # no local_files_only: the connection error falls back to the cache too
    check(download("main"), "main")
    with pytest.raises(LocalEntryNotFoundError):
        download("never-fetched", local_files_only=True)
    out = _offline_configs(local_hub, cache, ["main", "refs/pr/1", a.oid])
    assert out == {"main": '{"v": 2}', "refs/pr/1": '{"v": 3}', a.oid: '{"v": 1}'}

    # and back online on the same endpoint, state kept
    local_hub.start()
    assert api.repo_info(REPO, revision="main").sha == b.oid


def test_not_found_errors(local_hub, api, populated, tmp_path):
    kw = dict(cache_dir=tmp_path / "cache", endpoint=local_hub.endpoint, token=TOKEN)
    with pytest.raises(RepositoryNotFoundError):
        api.list_repo_files("org/missing")
    with pytest.raises(RepositoryNotFoundError):
        snapshot_download("org/missing", allow_patterns=PATTERNS, **kw)
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("org/missing", "cfp/math/cfp_config.json", **kw)
    with pytest.raises(RevisionNotFoundError):
        api.repo_info(REPO, revision="no-such-branch")
    with pytest.raises(RevisionNotFoundError):  # hf_cfp's push reads this as "a new branch"
        api.list_repo_files(REPO, revision="no-such-branch")
    with pytest.raises(RevisionNotFoundError):
        snapshot_download(REPO, revision="refs/pr/99", allow_patterns=PATTERNS, **kw)
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download(REPO, "cfp/math/cfp_config.json", revision="f" * 40, **kw)
    with pytest.raises(EntryNotFoundError):
        hf_hub_download(REPO, "cfp/nope/cfp_config.json", **kw)
    with pytest.raises(RevisionNotFoundError):  # refused at preupload
        api.create_commit(REPO, [CommitOperationAdd("x.txt", b"x")], commit_message="m", revision="nope")
    with pytest.raises(RevisionNotFoundError):  # no addition, no preupload: refused by the commit endpoint
        api.create_commit(REPO, [CommitOperationDelete("model.safetensors")], commit_message="m", revision="nope")
    with pytest.raises(HfHubHTTPError, match="does not support the commit operation 'deletedFolder'"):
        api.create_commit(REPO, [CommitOperationDelete("cfp/code/")], commit_message="folder delete")
    assert {"model.safetensors", "cfp/code/fisher.safetensors"} <= set(local_hub.files(REPO))


def test_failed_commits_leave_remote_unchanged(local_hub, api, populated, tmp_path):
    before = _state(local_hub)
    ops = _adds({"cfp_config.json": '{"v": 99}', "new.bin": b"new"})

    # a single injected 500 on the commit endpoint (create_commit does not retry it)
    local_hub.fail_next("/commit/", 500)
    with pytest.raises(HfHubHTTPError) as exc:
        api.create_commit(REPO, ops, commit_message="doomed")
    assert exc.value.response.status_code == 500
    assert _state(local_hub) == before

    # also with create_pr=True: no PR is opened
    local_hub.fail_next("/commit/", 500)
    with pytest.raises(HfHubHTTPError):
        api.create_commit(REPO, ops, commit_message="doomed", create_pr=True)
    assert _state(local_hub) == before  # refs included: no refs/pr/2

    # atomicity: a bad operation in the middle rejects the whole commit
    with pytest.raises(EntryNotFoundError):
        api.create_commit(REPO, [ops[0], CommitOperationDelete("cfp/math/absent.txt"), ops[1]], commit_message="half")
    assert _state(local_hub) == before

    # downloads: the client retries a request that got a 5xx when nothing is cached (one 500 is absorbed) ...
    kw = dict(cache_dir=tmp_path / "c2", endpoint=local_hub.endpoint, token=TOKEN)
    local_hub.fail_next("/resolve/", 500)
    with no_backoff_sleep():
        assert Path(hf_hub_download(REPO, "cfp/math/cfp_config.json", **kw)).read_bytes() == b'{"v": 2}'
    assert [r.status for r in local_hub.requests if "/resolve/" in r.raw_path][-3:] == [500, 200, 200]
    # ... a persistent one surfaces as LocalEntryNotFoundError chained to the HTTP error
    local_hub.fail_always("/resolve/", 500)
    with no_backoff_sleep(), pytest.raises(LocalEntryNotFoundError) as exc2:
        hf_hub_download(REPO, "cfp/math/fisher.safetensors", **kw)
    assert isinstance(exc2.value.__cause__, HfHubHTTPError)
    local_hub.clear_failures()

    # and the same commit goes through once the Hub is healthy
    ok = api.create_commit(REPO, ops, commit_message="finally")
    assert local_hub.resolve(REPO, "main") == ok.oid
    assert local_hub.files(REPO)["cfp/math/new.bin"] == b"new"


def test_offline_flag_blocks_client_and_hub_is_reusable():
    # the local_hub fixture flips huggingface_hub's offline flag; outside it, conftest's HF_HUB_OFFLINE=1 holds
    with LocalHub() as hub:
        with hub_offline_mode(True), pytest.raises(OfflineModeIsEnabled):
            HfApi(endpoint=hub.endpoint, token=TOKEN).create_repo(REPO)
        with hub_offline_mode(False):
            HfApi(endpoint=hub.endpoint, token=TOKEN).create_repo(REPO)
        assert hub.repo_exists(REPO)
        sha = hub.commit(REPO, {"cfp/math/x.bin": b"abc"}, message="seed")
        assert hub.history(REPO)[0] == {"oid": sha, "title": "seed"}


def test_default_endpoint_is_patched_by_the_fixture(local_hub, tmp_path):
    # a call that forgets endpoint= must still land on the local hub, never on huggingface.co
    api = HfApi(token=TOKEN)
    assert api.endpoint == local_hub.endpoint
    api.create_repo(REPO)
    local_hub.commit(REPO, {"cfp/math/cfp_config.json": "{}"}, message="seed")
    path = hf_hub_download(REPO, "cfp/math/cfp_config.json", cache_dir=tmp_path, token=TOKEN)
    assert Path(path).read_text() == "{}"
    assert os.environ["HF_ENDPOINT"] == local_hub.endpoint
