"""The local fake Hub (tests/hub_server.py) driven by the *real* huggingface_hub client."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support.hub_server import LocalHub, hub_offline_mode, no_backoff_sleep
from huggingface_hub import (
    CommitOperationAdd,
    CommitOperationDelete,
    HfApi,
    hf_hub_download,
    snapshot_download,
)
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

TOKEN = "fake-token"
REPO = "org/base-model"
PATTERNS = ["cfp/math/*"]


def _write(folder: Path, files: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for rel, content in files.items():
        p = folder / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content if isinstance(content, bytes) else content.encode())
    return folder


def _read_tree(root: str) -> dict:
    root_p = Path(root)
    return {p.relative_to(root_p).as_posix(): p.read_bytes() for p in sorted(root_p.rglob("*")) if p.is_file()}


def _state(hub: LocalHub, repo_id: str = REPO) -> tuple:
    return hub.refs(repo_id), [c["oid"] for c in hub.history(repo_id)], hub.files(repo_id)


@pytest.fixture
def api(local_hub):
    return HfApi(endpoint=local_hub.endpoint, token=TOKEN)


@pytest.fixture
def populated(local_hub, api, tmp_path):
    """main: initial -> A (cfp/math v1 + unrelated files) -> B (cfp/math v2); refs/pr/1: C on top of B."""
    api.create_repo(REPO, exist_ok=True)
    api.upload_file(repo_id=REPO, path_or_fileobj=b"base weights", path_in_repo="model.safetensors",
                    commit_message="base model")
    a = api.upload_folder(
        repo_id=REPO, folder_path=_write(tmp_path / "v1", {"fisher.safetensors": b"\x01" * 64,
                                                           "cfp_config.json": '{"v": 1}',
                                                           "README.md": "---\ntags: [cfp]\n---\n# Anchor\n"}),
        path_in_repo="cfp/math", commit_message="anchor v1")
    api.upload_folder(repo_id=REPO, folder_path=_write(tmp_path / "other", {"fisher.safetensors": b"\x09" * 8}),
                      path_in_repo="cfp/code", commit_message="another anchor")
    b = api.upload_folder(
        repo_id=REPO, folder_path=_write(tmp_path / "v2", {"fisher.safetensors": b"\x02" * 64,
                                                           "cfp_config.json": '{"v": 2}',
                                                           "README.md": "---\ntags: [cfp]\n---\n# Anchor\n"}),
        path_in_repo="cfp/math", commit_message="anchor v2")
    main_before_pr = local_hub.resolve(REPO, "main")
    c = api.upload_folder(
        repo_id=REPO, folder_path=_write(tmp_path / "v3", {"fisher.safetensors": b"\x03" * 64,
                                                           "cfp_config.json": '{"v": 3}'}),
        path_in_repo="cfp/math", commit_message="anchor v3 as PR", create_pr=True)
    return {"A": a, "B": b, "C": c, "main_before_pr": main_before_pr}


def test_create_repo_exist_ok(local_hub, api):
    url = api.create_repo(REPO, private=True)
    assert url.repo_id == REPO and url.endswith(f"/{REPO}")
    assert api.create_repo(REPO, exist_ok=True).repo_id == REPO
    with pytest.raises(HfHubHTTPError) as exc:
        api.create_repo(REPO)
    assert exc.value.response.status_code == 409
    info = api.repo_info(REPO)
    assert info.private is True and [s.rfilename for s in info.siblings] == [".gitattributes"]
    assert api.create_repo("just-a-name", repo_type="dataset").repo_id == "test-user/just-a-name"
    assert api.dataset_info("test-user/just-a-name").sha == local_hub.resolve("test-user/just-a-name",
                                                                               repo_type="dataset")


def test_commits_branches_and_pr(local_hub, api, populated):
    a, b, c = populated["A"], populated["B"], populated["C"]
    assert a.pr_url is None and b.pr_url is None
    # the PR commit landed on refs/pr/1 only; main is unchanged
    assert c.pr_revision == "refs/pr/1" and c.pr_num == 1
    assert local_hub.resolve(REPO, "refs/pr/1") == c.oid
    assert local_hub.resolve(REPO, "main") == b.oid == populated["main_before_pr"]
    assert local_hub.files(REPO, "main")["cfp/math/cfp_config.json"] == b'{"v": 2}'
    assert local_hub.files(REPO, "refs/pr/1")["cfp/math/cfp_config.json"] == b'{"v": 3}'
    # unchanged files were not re-sent (the server answers the remote oid at preupload)
    assert local_hub.files(REPO, "refs/pr/1")["cfp/math/README.md"].startswith(b"---")

    refs = api.list_repo_refs(REPO, include_pull_requests=True)
    assert [(r.name, r.target_commit) for r in refs.branches] == [("main", b.oid)]
    assert [(r.ref, r.target_commit) for r in refs.pull_requests] == [("refs/pr/1", c.oid)]
    titles = [cm.title for cm in api.list_repo_commits(REPO)]
    assert titles == ["anchor v2", "another anchor", "anchor v1", "base model", "initial commit"]
    assert api.list_repo_commits(REPO, revision="refs/pr/1")[0].commit_id == c.oid
    pr = api.get_discussion_details(REPO, 1)
    assert pr.is_pull_request and pr.git_reference == "refs/pr/1" and pr.target_branch == "refs/heads/main"

    # create_commit(create_pr=True) uses ?create_pr=1 on the commit endpoint instead of /discussions
    d = api.create_commit(REPO, [CommitOperationAdd("cfp/math/extra.txt", b"x")], commit_message="pr 2",
                          create_pr=True)
    assert d.pr_revision == "refs/pr/2" and local_hub.resolve(REPO, "main") == b.oid
    # explicit revision=branch and parent_commit
    api.create_branch(REPO, branch="anchors")  # from main = B
    e = api.create_commit(REPO, [CommitOperationDelete("cfp/code/")], commit_message="drop code anchor",
                          revision="anchors", parent_commit=b.oid)
    assert local_hub.resolve(REPO, "anchors") == e.oid and local_hub.resolve(REPO, "main") == b.oid
    assert not any(p.startswith("cfp/code/") for p in local_hub.files(REPO, "anchors"))
    api.create_tag(REPO, tag="v1", revision=a.oid)
    assert api.list_repo_refs(REPO).tags[0].target_commit == a.oid
    # tree / paths-info
    assert sorted(api.list_repo_files(REPO, revision="refs/pr/1")) == [
        ".gitattributes", "cfp/code/fisher.safetensors", "cfp/math/README.md", "cfp/math/cfp_config.json",
        "cfp/math/fisher.safetensors", "model.safetensors"]
    infos = api.get_paths_info(REPO, ["cfp/math/cfp_config.json", "cfp/math", "missing"], revision=a.oid)
    assert [(i.path, type(i).__name__) for i in infos] == [("cfp/math/cfp_config.json", "RepoFile"),
                                                           ("cfp/math", "RepoFolder")]
    assert infos[0].size == len(b'{"v": 1}')
    # merge the first PR: main gets the PR's changes
    api.merge_pull_request(REPO, 1)
    assert local_hub.files(REPO, "main")["cfp/math/cfp_config.json"] == b'{"v": 3}'


def test_downloads_by_branch_sha_tag_pr_and_offline_reuse(local_hub, api, populated, tmp_path):
    a, b, c = populated["A"], populated["B"], populated["C"]
    api.create_tag(REPO, tag="v1", revision=a.oid)
    cache = tmp_path / "cache"
    expected = {
        "main": (b.oid, b'{"v": 2}', b"\x02" * 64),
        a.oid: (a.oid, b'{"v": 1}', b"\x01" * 64),
        "v1": (a.oid, b'{"v": 1}', b"\x01" * 64),
        "refs/pr/1": (c.oid, b'{"v": 3}', b"\x03" * 64),
    }

    def check(path: str, rev: str) -> None:
        sha, config, tensors = expected[rev]
        assert Path(path).name == sha  # snapshot folder = resolved commit
        tree = _read_tree(path)
        assert set(tree) <= {"cfp/math/README.md", "cfp/math/cfp_config.json", "cfp/math/fisher.safetensors"}
        assert tree["cfp/math/cfp_config.json"] == config and tree["cfp/math/fisher.safetensors"] == tensors

    for rev in expected:
        check(snapshot_download(REPO, revision=rev, allow_patterns=PATTERNS, cache_dir=cache,
                                endpoint=local_hub.endpoint, token=TOKEN), rev)
    # PR refs travel URL-encoded
    assert local_hub.requests_matching("/api/models/org/base-model/revision/refs/pr/1")
    assert any("/revision/refs%2Fpr%2F1" in r.raw_path for r in local_hub.requests)
    one = hf_hub_download(REPO, "cfp/math/cfp_config.json", revision="refs/pr/1", cache_dir=cache,
                          endpoint=local_hub.endpoint, token=TOKEN)
    assert Path(one).read_bytes() == b'{"v": 3}'

    # --- the Hub goes away: everything is served from the cache
    local_hub.stop()
    for rev in expected:
        check(snapshot_download(REPO, revision=rev, allow_patterns=PATTERNS, cache_dir=cache,
                                endpoint=local_hub.endpoint, token=TOKEN, local_files_only=True), rev)
    # no local_files_only: the connection error falls back to the cache too
    check(snapshot_download(REPO, revision="main", allow_patterns=PATTERNS, cache_dir=cache,
                            endpoint=local_hub.endpoint, token=TOKEN), "main")
    with pytest.raises(LocalEntryNotFoundError):
        snapshot_download(REPO, revision="never-fetched", allow_patterns=PATTERNS, cache_dir=cache,
                          endpoint=local_hub.endpoint, token=TOKEN, local_files_only=True)

    # HF_HUB_OFFLINE=1 in a fresh process (the flag is read at import time)
    script = textwrap.dedent(f"""
        import json
        from huggingface_hub import snapshot_download
        out = {{}}
        for rev in ["main", "refs/pr/1", "{a.oid}"]:
            p = snapshot_download("{REPO}", revision=rev, allow_patterns={PATTERNS!r}, cache_dir={str(cache)!r})
            out[rev] = open(p + "/cfp/math/cfp_config.json").read()
        print(json.dumps(out))
    """)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": local_hub.endpoint}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == (
        '{"main": "{\\"v\\": 2}", "refs/pr/1": "{\\"v\\": 3}", "%s": "{\\"v\\": 1}"}' % a.oid)

    # and back online on the same endpoint, state kept
    local_hub.start()
    assert api.repo_info(REPO).sha == b.oid


def test_not_found_errors(local_hub, api, populated, tmp_path):
    cache = tmp_path / "cache"
    kw = dict(cache_dir=cache, endpoint=local_hub.endpoint, token=TOKEN)
    with pytest.raises(RepositoryNotFoundError):
        api.repo_info("org/missing")
    with pytest.raises(RepositoryNotFoundError):
        snapshot_download("org/missing", allow_patterns=PATTERNS, **kw)
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("org/missing", "cfp/math/cfp_config.json", **kw)
    with pytest.raises(RevisionNotFoundError):
        api.repo_info(REPO, revision="no-such-branch")
    with pytest.raises(RevisionNotFoundError):
        snapshot_download(REPO, revision="refs/pr/99", allow_patterns=PATTERNS, **kw)
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download(REPO, "cfp/math/cfp_config.json", revision="f" * 40, **kw)
    with pytest.raises(EntryNotFoundError):
        hf_hub_download(REPO, "cfp/nope/cfp_config.json", **kw)
    with pytest.raises(EntryNotFoundError):
        api.list_repo_tree(REPO, path_in_repo="cfp/nope").__iter__().__next__()
    with pytest.raises(RevisionNotFoundError):
        api.create_commit(REPO, [CommitOperationAdd("x.txt", b"x")], commit_message="m", revision="nope")
    # injected 404 on an existing file
    local_hub.not_found("cfp/math/fisher.safetensors")
    with pytest.raises(EntryNotFoundError):
        hf_hub_download(REPO, "cfp/math/fisher.safetensors", **kw)
    local_hub.clear_failures()
    assert Path(hf_hub_download(REPO, "cfp/math/fisher.safetensors", **kw)).read_bytes() == b"\x02" * 64


def test_failed_commits_leave_remote_unchanged(local_hub, api, populated, tmp_path):
    before = _state(local_hub)
    ops = [CommitOperationAdd("cfp/math/cfp_config.json", b'{"v": 99}'),
           CommitOperationAdd("cfp/math/new.bin", b"new")]

    # a single injected 500 on the commit endpoint (create_commit does not retry)
    local_hub.fail_next("/commit/", 500)
    with pytest.raises(HfHubHTTPError) as exc:
        api.create_commit(REPO, ops, commit_message="doomed")
    assert exc.value.response.status_code == 500
    assert _state(local_hub) == before

    # also with create_pr=True: no PR is opened
    local_hub.fail_next("/commit/", 500)
    with pytest.raises(HfHubHTTPError):
        api.create_commit(REPO, [CommitOperationAdd("cfp/math/new.bin", b"new")], commit_message="doomed",
                          create_pr=True)
    assert _state(local_hub) == before and set(local_hub.pull_requests(REPO)) == {1}

    # upload_folder (hf_xet pipeline) retries 5xx with backoff: a persistent 500 still fails cleanly
    folder = _write(tmp_path / "up", {"cfp_config.json": '{"v": 99}', "new.bin": b"new"})
    local_hub.fail_always("/commit/", 503)
    with no_backoff_sleep(), pytest.raises(HfHubHTTPError):
        api.upload_folder(repo_id=REPO, folder_path=folder, path_in_repo="cfp/math", commit_message="doomed")
    local_hub.clear_failures()
    assert _state(local_hub) == before
    assert len(local_hub.requests_matching("/commit/", "POST")) >= 3

    # atomicity: a bad operation in the middle rejects the whole commit
    with pytest.raises(EntryNotFoundError):
        api.create_commit(REPO, [ops[0], CommitOperationDelete("cfp/math/absent.txt"), ops[1]],
                          commit_message="half")
    # stale parent_commit -> 412
    with pytest.raises(HfHubHTTPError) as exc:
        api.create_commit(REPO, ops, commit_message="stale", parent_commit=populated["A"].oid)
    assert exc.value.response.status_code == 412
    assert _state(local_hub) == before

    # downloads: the client retries a HEAD that got a 5xx when nothing is cached (one 500 is absorbed) ...
    kw = dict(cache_dir=tmp_path / "c2", endpoint=local_hub.endpoint, token=TOKEN)
    local_hub.fail_next("/resolve/", 500, method="HEAD")
    assert Path(hf_hub_download(REPO, "cfp/math/cfp_config.json", **kw)).read_bytes() == b'{"v": 2}'
    # ... a persistent one surfaces as LocalEntryNotFoundError chained to the HTTP error
    local_hub.fail_always("/resolve/", 500, method="HEAD")
    with no_backoff_sleep(), pytest.raises(LocalEntryNotFoundError) as exc2:
        hf_hub_download(REPO, "cfp/math/fisher.safetensors", **kw)
    assert isinstance(exc2.value.__cause__, HfHubHTTPError)
    local_hub.clear_failures()

    # and the same commit goes through once the Hub is healthy
    ok = api.create_commit(REPO, ops, commit_message="finally", parent_commit=before[0]["refs/heads/main"])
    assert local_hub.resolve(REPO, "main") == ok.oid
    assert local_hub.files(REPO)["cfp/math/new.bin"] == b"new"


def test_offline_flag_blocks_client_and_hub_is_reusable():
    # the local_hub fixture flips huggingface_hub's offline flag; outside it, conftest's HF_HUB_OFFLINE=1 holds
    with LocalHub() as hub:
        with hub_offline_mode(True):
            with pytest.raises(Exception):
                HfApi(endpoint=hub.endpoint, token=TOKEN).create_repo(REPO)
        with hub_offline_mode(False):
            HfApi(endpoint=hub.endpoint, token=TOKEN).create_repo(REPO)
        assert hub.repo_exists(REPO)
        sha = hub.commit(REPO, {"cfp/math/x.bin": b"abc"}, message="seed")
        assert hub.history(REPO)[0]["oid"] == sha


def test_default_endpoint_is_patched_by_the_fixture(local_hub, tmp_path):
    # a call that forgets endpoint= must still land on the local hub, never on huggingface.co
    api = HfApi(token=TOKEN)
    assert api.endpoint == local_hub.endpoint
    api.create_repo(REPO)
    local_hub.commit(REPO, {"cfp/math/cfp_config.json": "{}"}, message="seed")
    path = hf_hub_download(REPO, "cfp/math/cfp_config.json", cache_dir=tmp_path, token=TOKEN)
    assert Path(path).read_text() == "{}"
    assert os.environ["HF_ENDPOINT"] == local_hub.endpoint
