"""A local, in-memory fake of the Hugging Face Hub for tests.

`LocalHub` is a stdlib HTTP server (``http.server.ThreadingHTTPServer`` on 127.0.0.1, ephemeral port)
that answers the endpoints the *real* ``huggingface_hub`` client (2.x) calls for:

* ``HfApi.create_repo`` / ``delete_repo`` / ``repo_info`` / ``model_info`` / ``dataset_info`` /
  ``list_repo_refs`` / ``list_repo_commits`` / ``list_repo_tree`` / ``list_repo_files`` /
  ``get_paths_info`` / ``create_branch`` / ``delete_branch`` / ``create_tag`` / ``delete_tag`` /
  ``create_pull_request`` / ``get_discussion_details`` / ``merge_pull_request`` / ``whoami``;
* ``create_commit`` and ``upload_folder`` / ``upload_file`` (``revision=``, ``create_pr=True``,
  ``parent_commit=``): the preupload endpoint always answers ``uploadMode: "regular"`` so that file
  contents travel inline (base64) in the NDJSON commit payload; the LFS/Xet path is never used;
* ``hf_hub_download`` / ``snapshot_download`` by branch, tag, ``refs/pr/N`` or full commit sha
  (``HEAD``/``GET /{repo_id}/resolve/{rev}/{path}`` with ``X-Repo-Commit``, a content-hash ``ETag``
  = git blob sha1, exact ``Content-Length``, ``Range`` support).

Storage is git-like: every commit has a 40-hex sha, a parent, and a full snapshot of the tree;
refs are ``refs/heads/<branch>``, ``refs/tags/<tag>`` and ``refs/pr/<N>``. A commit is atomic: it
is validated completely before the ref moves (all files or nothing).

Errors use the Hub's ``X-Error-Code`` header (``RepoNotFound``, ``RevisionNotFound``,
``EntryNotFound``) so the client raises ``RepositoryNotFoundError`` / ``RevisionNotFoundError`` /
``RemoteEntryNotFoundError`` (an ``EntryNotFoundError``). Failures can be injected per path
substring (``fail_next``, ``fail_always``, ``not_found``).

Client-side notes (huggingface_hub 2.4):

* ``huggingface_hub.constants.HF_HUB_OFFLINE`` is read from the environment at import time and the
  repo's ``tests/conftest.py`` sets ``HF_HUB_OFFLINE=1``: use the ``local_hub`` fixture (it flips the
  constant off for the test) or the ``hub_offline_mode(False)`` context manager. Always pass
  ``endpoint=hub.endpoint`` explicitly (``HF_ENDPOINT`` is also read at import time).
* With ``hf_xet`` installed, ``upload_folder`` goes through a pipelined multi-commit uploader that
  opens a PR with ``POST /discussions`` and then commits to ``refs/pr/N``; it retries commits on 5xx
  with exponential backoff (about 23 s) -- use ``no_backoff_sleep()`` in tests that inject 5xx into
  such uploads. ``create_commit`` sends ``?create_pr=1`` on the commit endpoint and does not retry.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import fnmatch
import hashlib
import itertools
import json
import os
import threading
import time
import types
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator
from urllib.parse import parse_qs, unquote, urlsplit

__all__ = [
    "LocalHub",
    "HubError",
    "RequestRecord",
    "git_blob_sha1",
    "hub_offline_mode",
    "no_backoff_sleep",
    "local_hub",
]

REPO_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space", "kernels": "kernel"}
URL_PREFIXES = {"model": "", "dataset": "datasets/", "space": "spaces/", "kernel": "kernels/"}
GITATTRIBUTES = (
    b"*.bin filter=lfs diff=lfs merge=lfs -text\n"
    b"*.pt filter=lfs diff=lfs merge=lfs -text\n"
    b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"
)


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a blob (what ``git hash-object`` prints); used as the ETag."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _now_iso() -> str:
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + ".%03dZ" % int((t % 1) * 1000)


class HubError(Exception):
    """Raised inside the server to answer an HTTP error (also by the server-side helpers)."""

    def __init__(self, status: int, message: str, code: str | None = None, headers: dict | None = None,
                 extra: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.headers = headers or {}
        self.extra = extra or {}  # more fields for the JSON error body


@dataclass
class Commit:
    oid: str
    parents: list[str]
    files: dict[str, bytes]
    title: str
    message: str
    date: str
    author: str


@dataclass
class Discussion:
    num: int
    title: str
    description: str
    is_pull_request: bool
    author: str
    created_at: str
    base_ref: str  # e.g. "refs/heads/main"
    start_oid: str | None  # head of base when the PR was opened
    status: str = "open"


@dataclass
class Repo:
    repo_type: str
    repo_id: str
    private: bool
    created_at: str
    commits: dict[str, Commit] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)  # full ref name -> commit oid
    discussions: dict[int, Discussion] = field(default_factory=dict)


@dataclass
class RequestRecord:
    method: str
    path: str  # unquoted path, without query
    query: str
    status: int
    raw_path: str = ""  # as sent, e.g. ".../revision/refs%2Fpr%2F1"


@dataclass
class _FailureRule:
    substring: str
    status: int
    remaining: int | None  # None: forever
    method: str | None
    code: str | None
    message: str


def _validate_path(path: str) -> str:
    if not path or path.startswith("/") or "\\" in path:
        raise HubError(400, f"Invalid path in repo: {path!r}")
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts) or ".git" == parts[0]:
        raise HubError(400, f"Invalid path in repo: {path!r}")
    return path


class LocalHub:
    """In-memory fake Hub served over HTTP on 127.0.0.1.

    Usage::

        with LocalHub() as hub:
            api = HfApi(endpoint=hub.endpoint, token="fake-token")
            api.create_repo("org/model", exist_ok=True)

    Any token is accepted. ``create_repo`` makes an initial commit holding ``.gitattributes``
    (like the real Hub), unless ``initial_gitattributes=False``.
    """

    def __init__(self, *, username: str = "test-user", host: str = "127.0.0.1", port: int = 0,
                 initial_gitattributes: bool = True):
        self.username = username
        self.host = host
        self._port = port
        self.initial_gitattributes = initial_gitattributes
        self._lock = threading.RLock()
        self._repos: dict[tuple[str, str], Repo] = {}
        self._failures: list[_FailureRule] = []
        self._counter = itertools.count(1)
        self.requests: list[RequestRecord] = []
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def port(self) -> int:
        return self._port

    @property
    def endpoint(self) -> str:
        """Base URL to pass as ``endpoint=`` to the client, e.g. ``http://127.0.0.1:41234``."""
        if not self._port:
            raise RuntimeError("LocalHub has not been started")
        return f"http://{self.host}:{self._port}"

    @property
    def running(self) -> bool:
        return self._server is not None

    def start(self) -> "LocalHub":
        """Start serving (idempotent). After ``stop()``, restarts on the same port, state kept."""
        if self._server is not None:
            return self
        _ensure_no_proxy(self.host)
        handler = type("_BoundHandler", (_Handler,), {"hub": self})
        server = ThreadingHTTPServer((self.host, self._port), handler)
        server.daemon_threads = True
        self._port = server.server_address[1]
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"LocalHub:{self._port}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving; connections are refused afterwards (simulates being offline)."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    @contextlib.contextmanager
    def as_default_endpoint(self) -> Iterator["LocalHub"]:
        """Make this hub huggingface_hub's *default* endpoint for the duration (patches
        ``constants.ENDPOINT`` / ``HUGGINGFACE_CO_URL_TEMPLATE``, read at import time, and sets
        ``HF_ENDPOINT`` for subprocesses), so that a call that forgets ``endpoint=`` still lands here
        instead of huggingface.co. ``HfApi()`` must be created inside the block."""
        from huggingface_hub import constants

        saved = (constants.ENDPOINT, constants.HUGGINGFACE_CO_URL_TEMPLATE, os.environ.get("HF_ENDPOINT"))
        constants.ENDPOINT = self.endpoint
        constants.HUGGINGFACE_CO_URL_TEMPLATE = self.endpoint + "/{repo_id}/resolve/{revision}/{filename}"
        os.environ["HF_ENDPOINT"] = self.endpoint
        try:
            yield self
        finally:
            constants.ENDPOINT, constants.HUGGINGFACE_CO_URL_TEMPLATE = saved[0], saved[1]
            if saved[2] is None:
                os.environ.pop("HF_ENDPOINT", None)
            else:
                os.environ["HF_ENDPOINT"] = saved[2]

    def __enter__(self) -> "LocalHub":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ failure injection

    def fail_next(self, path_substring: str, status: int = 500, *, times: int | None = 1,
                  method: str | None = None, error_code: str | None = None,
                  message: str | None = None) -> None:
        """Answer ``status`` to the next ``times`` requests (``None``: all of them) whose path
        contains ``path_substring`` (matched against both the raw and the URL-decoded path, e.g.
        ``"/commit/"``, ``"cfp/math/"``, ``"refs/pr/1"``), optionally only for ``method``.
        ``error_code`` sets ``X-Error-Code``. Injected failures happen before any state change."""
        with self._lock:
            self._failures.append(_FailureRule(
                substring=path_substring, status=status, remaining=times,
                method=method.upper() if method else None, code=error_code,
                message=message or f"Injected failure ({status}) for {path_substring!r}"))

    def fail_always(self, path_substring: str, status: int = 500, **kwargs: Any) -> None:
        """Like ``fail_next`` but until ``clear_failures()``."""
        self.fail_next(path_substring, status, times=None, **kwargs)

    def not_found(self, path_substring: str, *, error_code: str = "EntryNotFound",
                  times: int | None = None, method: str | None = None) -> None:
        """Make matching paths answer 404 with ``X-Error-Code: error_code``
        (``EntryNotFound``, ``RevisionNotFound`` or ``RepoNotFound``)."""
        self.fail_next(path_substring, 404, times=times, method=method, error_code=error_code,
                       message=f"{error_code}: {path_substring!r} (injected)")

    def clear_failures(self) -> None:
        with self._lock:
            self._failures.clear()

    def _match_failure(self, method: str, raw_path: str, path: str) -> _FailureRule | None:
        with self._lock:
            for rule in self._failures:
                if rule.method and rule.method != method:
                    continue
                if rule.substring in raw_path or rule.substring in path:
                    if rule.remaining is not None:
                        rule.remaining -= 1
                        if rule.remaining <= 0:
                            self._failures.remove(rule)
                    return rule
        return None

    # ------------------------------------------------------------------ request log

    def reset_requests(self) -> None:
        with self._lock:
            self.requests.clear()

    def requests_matching(self, substring: str, method: str | None = None) -> list[RequestRecord]:
        with self._lock:
            return [r for r in self.requests
                    if substring in r.path and (method is None or r.method == method.upper())]

    # ------------------------------------------------------------------ server-side helpers (no HTTP)

    def create_repo(self, repo_id: str, *, repo_type: str = "model", private: bool = False,
                    exist_ok: bool = False) -> str:
        """Create a repo directly in the store; returns the sha of its initial commit."""
        with self._lock:
            key = (repo_type, repo_id)
            if key in self._repos:
                if exist_ok:
                    return self._repos[key].refs["refs/heads/main"]
                raise HubError(409, "You already created this model repo")
            repo = Repo(repo_type=repo_type, repo_id=repo_id, private=bool(private), created_at=_now_iso())
            files = {".gitattributes": GITATTRIBUTES} if self.initial_gitattributes else {}
            commit = self._new_commit(repo, None, files, "initial commit", "")
            repo.refs["refs/heads/main"] = commit.oid
            self._repos[key] = repo
            return commit.oid

    def delete_repo(self, repo_id: str, *, repo_type: str = "model") -> None:
        with self._lock:
            self._repo(repo_type, repo_id)
            del self._repos[(repo_type, repo_id)]

    def repo_exists(self, repo_id: str, *, repo_type: str = "model") -> bool:
        with self._lock:
            return (repo_type, repo_id) in self._repos

    def commit(self, repo_id: str, files: dict[str, bytes | str] | None = None, *,
               deletes: tuple[str, ...] | list[str] = (), revision: str = "main",
               message: str = "server-side commit", repo_type: str = "model",
               parent_commit: str | None = None) -> str:
        """Commit directly (bypassing HTTP), e.g. to seed a repo or plant a corrupt file.
        Returns the new commit sha."""
        adds = {p: (c.encode() if isinstance(c, str) else bytes(c)) for p, c in (files or {}).items()}
        with self._lock:
            repo = self._repo(repo_type, repo_id)
            oid, _ = self._apply_commit(repo, revision, adds, list(deletes), [], message, "",
                                        parent_commit, create_pr=False)
            return oid

    def create_branch(self, repo_id: str, branch: str, *, revision: str = "main",
                      repo_type: str = "model") -> str:
        return self._create_ref(repo_type, repo_id, "heads", "Branch", branch, revision)

    def create_tag(self, repo_id: str, tag: str, *, revision: str = "main", repo_type: str = "model") -> str:
        return self._create_ref(repo_type, repo_id, "tags", "Tag", tag, revision)

    def _create_ref(self, repo_type: str, repo_id: str, kind: str, label: str, name: str, revision: str) -> str:
        with self._lock:
            repo = self._repo(repo_type, repo_id)
            ref = f"refs/{kind}/{name}"
            if ref in repo.refs:
                raise HubError(409, f"{label} {name} already exists")
            repo.refs[ref] = self._resolve(repo, revision)
            return repo.refs[ref]

    def resolve(self, repo_id: str, revision: str = "main", *, repo_type: str = "model") -> str:
        """Commit sha of a branch / tag / ``refs/pr/N`` / sha; raises ``HubError`` (404)."""
        with self._lock:
            return self._resolve(self._repo(repo_type, repo_id), revision)

    def files(self, repo_id: str, revision: str = "main", *, repo_type: str = "model") -> dict[str, bytes]:
        """Snapshot ``{path: content}`` of a revision."""
        with self._lock:
            repo = self._repo(repo_type, repo_id)
            return dict(repo.commits[self._resolve(repo, revision)].files)

    def refs(self, repo_id: str, *, repo_type: str = "model") -> dict[str, str]:
        """``{"refs/heads/main": sha, "refs/pr/1": sha, ...}``."""
        with self._lock:
            return dict(self._repo(repo_type, repo_id).refs)

    def history(self, repo_id: str, revision: str = "main", *, repo_type: str = "model") -> list[dict]:
        """Commits reachable from ``revision``, newest first: ``{oid, title, message, parents}``."""
        with self._lock:
            repo = self._repo(repo_type, repo_id)
            return [{"oid": c.oid, "title": c.title, "message": c.message, "parents": list(c.parents)}
                    for c in self._ancestors(repo, self._resolve(repo, revision))]

    def pull_requests(self, repo_id: str, *, repo_type: str = "model") -> dict[int, Discussion]:
        with self._lock:
            return {n: copy.copy(d) for n, d in self._repo(repo_type, repo_id).discussions.items()
                    if d.is_pull_request}

    # ------------------------------------------------------------------ internals: store

    def _repo(self, repo_type: str, repo_id: str) -> Repo:
        repo = self._repos.get((repo_type, repo_id))
        if repo is None:
            raise HubError(404, f"Repository Not Found: {repo_type} {repo_id}", "RepoNotFound")
        return repo

    def _resolve(self, repo: Repo, revision: str) -> str:
        rev = revision
        for ref in (rev, f"refs/heads/{rev}", f"refs/tags/{rev}"):
            if ref.startswith("refs/") and ref in repo.refs:
                return repo.refs[ref]
        if len(rev) == 40 and rev in repo.commits:
            return rev
        if 7 <= len(rev) < 40 and all(c in "0123456789abcdef" for c in rev):
            matches = [oid for oid in repo.commits if oid.startswith(rev)]
            if len(matches) == 1:
                return matches[0]
        raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")

    def _writable_ref(self, repo: Repo, revision: str) -> str:
        if revision.startswith("refs/"):
            ref = revision
        else:
            ref = f"refs/heads/{revision}"
        if ref not in repo.refs:
            if ref.startswith("refs/tags/") or f"refs/tags/{revision}" in repo.refs or revision in repo.commits:
                raise HubError(400, f"Cannot commit to {revision}: not a branch or a pull request ref")
            raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        if ref.startswith("refs/tags/"):
            raise HubError(400, f"Cannot commit to tag {revision}")
        return ref

    def _new_commit(self, repo: Repo, parent: str | None, files: dict[str, bytes], title: str,
                    message: str) -> Commit:
        n = next(self._counter)
        digest = hashlib.sha1(
            f"{repo.repo_type}/{repo.repo_id}\0{parent}\0{n}\0{time.time_ns()}\0{title}".encode()
            + b"".join(git_blob_sha1(files[p]).encode() + p.encode() for p in sorted(files))
        ).hexdigest()
        commit = Commit(oid=digest, parents=[parent] if parent else [], files=dict(files), title=title,
                        message=message, date=_now_iso(), author=self.username)
        repo.commits[commit.oid] = commit
        return commit

    def _ancestors(self, repo: Repo, oid: str) -> Iterator[Commit]:
        seen: set[str] = set()
        stack = [oid]
        while stack:
            cur = stack.pop(0)
            if cur in seen:
                continue
            seen.add(cur)
            commit = repo.commits[cur]
            yield commit
            stack.extend(commit.parents)

    def _open_pr(self, repo: Repo, title: str, description: str, base: str = "main") -> Discussion:
        base_ref = self._writable_ref(repo, base)
        num = max(repo.discussions, default=0) + 1
        disc = Discussion(num=num, title=title or f"PR #{num}", description=description or "",
                          is_pull_request=True, author=self.username, created_at=_now_iso(),
                          base_ref=base_ref, start_oid=repo.refs[base_ref], status="draft")
        repo.discussions[num] = disc
        repo.refs[f"refs/pr/{num}"] = repo.refs[base_ref]
        return disc

    def _apply_commit(self, repo: Repo, revision: str, adds: dict[str, bytes], deletes: list[str],
                      deleted_folders: list[str], title: str, message: str, parent_commit: str | None,
                      create_pr: bool, pr_title: str | None = None) -> tuple[str, Discussion | None]:
        """Validate everything, then move the ref: all or nothing. Caller holds the lock."""
        deleted_folders = [f.rstrip("/") for f in deleted_folders]
        for p in itertools.chain(adds, deletes, deleted_folders):
            _validate_path(p)
        base_ref = self._writable_ref(repo, revision)
        head = repo.refs[base_ref]
        if parent_commit is not None and parent_commit != head:
            raise HubError(412, "A commit has happened since. Please refresh and try again.")
        files = dict(repo.commits[head].files)
        for p in deletes:
            if p not in files:
                raise HubError(404, f"A file with this name doesn't exist: {p}", "EntryNotFound")
            del files[p]
        for folder in deleted_folders:
            prefix = folder.rstrip("/") + "/"
            doomed = [p for p in files if p.startswith(prefix)]
            if not doomed:
                raise HubError(404, f"A folder with this name doesn't exist: {folder}", "EntryNotFound")
            for p in doomed:
                del files[p]
        files.update(adds)
        for p in files:  # a path cannot be both a file and a folder
            parts = p.split("/")
            for i in range(1, len(parts)):
                if "/".join(parts[:i]) in files:
                    raise HubError(400, f"Path {p!r} conflicts with file {'/'.join(parts[:i])!r}")
        pr = None
        if create_pr:
            pr = self._open_pr(repo, pr_title or title, message, base=revision)
            base_ref = f"refs/pr/{pr.num}"
        commit = self._new_commit(repo, head, files, title, message)
        repo.refs[base_ref] = commit.oid
        return commit.oid, pr

    def _last_commit_touching(self, repo: Repo, head: str, path: str, is_dir: bool) -> Commit:
        def state(c: Commit):
            if is_dir:
                pre = path + "/"
                return sorted((p, git_blob_sha1(b)) for p, b in c.files.items() if p.startswith(pre))
            b = c.files.get(path)
            return None if b is None else git_blob_sha1(b)

        cur = repo.commits[head]
        mine = state(cur)
        while cur.parents:
            parent = repo.commits[cur.parents[0]]
            if state(parent) != mine:
                return cur
            cur = parent
        return cur

    def _tree_entry(self, repo: Repo, commit: Commit, path: str, expand: bool) -> dict | None:
        if path in commit.files:
            data = commit.files[path]
            entry = {"type": "file", "oid": git_blob_sha1(data), "size": len(data), "path": path}
            is_dir = False
        elif any(p.startswith(path + "/") for p in commit.files):
            sub = sorted((p, git_blob_sha1(b)) for p, b in commit.files.items() if p.startswith(path + "/"))
            entry = {"type": "directory", "oid": hashlib.sha1(json.dumps(sub).encode()).hexdigest(),
                     "size": 0, "path": path}
            is_dir = True
        else:
            return None
        if expand:
            last = self._last_commit_touching(repo, commit.oid, path, is_dir)
            entry["lastCommit"] = {"id": last.oid, "title": last.title, "date": last.date}
        return entry

    def _repo_url(self, repo: Repo) -> str:
        return f"{self.endpoint}/{URL_PREFIXES[repo.repo_type]}{repo.repo_id}"

    def _discussion_json(self, repo: Repo, disc: Discussion) -> dict:
        return {
            "num": disc.num, "title": disc.title, "status": disc.status,
            "isPullRequest": disc.is_pull_request, "createdAt": disc.created_at,
            "author": {"name": disc.author},
            "repo": {"name": repo.repo_id, "type": repo.repo_type},
            "events": [{"id": f"evt{disc.num}", "type": "comment", "createdAt": disc.created_at,
                        "author": {"name": disc.author},
                        "data": {"edited": False, "hidden": False, "latest": {"raw": disc.description}}}],
            "changes": {"base": disc.base_ref},
            "filesWithConflicts": [],
            "diff": "",
            "pinned": False,
        }

    def _info_json(self, repo: Repo, commit: Commit, blobs: bool) -> dict:
        siblings = []
        for p in sorted(commit.files):
            s: dict[str, Any] = {"rfilename": p}
            if blobs:
                s.update(size=len(commit.files[p]), blobId=git_blob_sha1(commit.files[p]))
            siblings.append(s)
        ns = repo.repo_id.split("/")[0] if "/" in repo.repo_id else None
        return {
            "_id": hashlib.md5(f"{repo.repo_type}/{repo.repo_id}".encode()).hexdigest()[:24],
            "id": repo.repo_id, "modelId": repo.repo_id, "author": ns, "sha": commit.oid,
            "lastModified": commit.date, "createdAt": repo.created_at, "private": repo.private,
            "gated": False, "disabled": False, "downloads": 0, "likes": 0, "tags": [],
            "siblings": siblings, "usedStorage": sum(len(b) for b in commit.files.values()),
        }


# ---------------------------------------------------------------------- HTTP handler


class _Handler(BaseHTTPRequestHandler):
    hub: LocalHub  # set on the bound subclass
    # HTTP/1.0: one request per connection, so that stop() really makes the hub unreachable (no
    # keep-alive connection pooled by the client can outlive the server).
    protocol_version = "HTTP/1.0"
    server_version = "LocalHub/1.0"

    def log_message(self, format: str, *args: Any) -> None:  # silence stderr logging
        pass

    # -- plumbing --------------------------------------------------------

    def do_GET(self):
        self._dispatch("GET")

    def do_HEAD(self):
        self._dispatch("HEAD")

    def do_POST(self):
        self._dispatch("POST")

    def do_PUT(self):
        self._dispatch("PUT")

    def do_DELETE(self):
        self._dispatch("DELETE")

    def _read_body(self) -> bytes:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(chunks)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None,
              content_type: str = "application/json") -> None:
        self._status = status
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD" and body:
            self.wfile.write(body)

    def _json(self, obj: Any, status: int = 200, headers: dict | None = None) -> None:
        self._send(status, json.dumps(obj).encode(), headers)

    def _error(self, err: HubError) -> None:
        headers = dict(err.headers)
        if err.code:
            headers["X-Error-Code"] = err.code
        headers["X-Error-Message"] = err.message.replace("\n", " ")[:500]
        self._json({**err.extra, "error": err.message}, err.status, headers)

    def _dispatch(self, method: str) -> None:
        self._status = 0
        split = urlsplit(self.path)
        raw_path = split.path
        segs = [unquote(s) for s in raw_path.split("/")[1:]]
        if segs and segs[-1] == "":
            segs = segs[:-1]
        decoded = "/" + "/".join(segs)
        self._query = parse_qs(split.query, keep_blank_values=True)
        try:
            body = self._read_body() if method in ("POST", "PUT", "DELETE") else b""
            rule = self.hub._match_failure(method, raw_path, decoded)
            if rule is not None:
                raise HubError(rule.status, rule.message, rule.code)
            self._route(method, segs, body)
        except HubError as err:
            self._error(err)
        except Exception as exc:  # a bug in the fake: surface it as a 500 with the message
            self._error(HubError(500, f"LocalHub internal error: {type(exc).__name__}: {exc}"))
        finally:
            with self.hub._lock:
                self.hub.requests.append(RequestRecord(method, decoded, split.query, self._status, raw_path))

    def _q(self, name: str, default: str | None = None) -> str | None:
        vals = self._query.get(name)
        return vals[0] if vals else default

    def _qbool(self, name: str) -> bool:
        return (self._q(name, "") or "").lower() in ("1", "true", "yes")

    @staticmethod
    def _take_rev(segs: list[str]) -> tuple[str, list[str]]:
        """First segment is the (already URL-decoded) revision; tolerate an unencoded refs/pr/N."""
        if not segs:
            raise HubError(400, "Missing revision")
        if segs[0] == "refs" and len(segs) >= 3 and segs[1] in ("pr", "heads", "tags", "convert"):
            return "/".join(segs[:3]), segs[3:]
        return segs[0], segs[1:]

    def _split_repo(self, repo_type: str, segs: list[str]) -> tuple[Repo, list[str]]:
        """``segs`` starts with the repo id (``ns/name`` or a legacy single-segment id)."""
        hub = self.hub
        if len(segs) >= 2 and (repo_type, f"{segs[0]}/{segs[1]}") in hub._repos:
            return hub._repos[(repo_type, f"{segs[0]}/{segs[1]}")], segs[2:]
        if segs and (repo_type, segs[0]) in hub._repos:
            return hub._repos[(repo_type, segs[0])], segs[1:]
        name = "/".join(segs[:2]) if segs else ""
        raise HubError(404, f"Repository Not Found for {repo_type} {name!r}", "RepoNotFound")

    # -- routing ---------------------------------------------------------

    def _route(self, method: str, segs: list[str], body: bytes) -> None:
        hub = self.hub
        if segs[:1] == ["api"]:
            rest = segs[1:]
            if rest == ["repos", "create"] and method == "POST":
                return self._create_repo(body)
            if rest == ["repos", "delete"] and method == "DELETE":
                return self._delete_repo(body)
            if rest == ["validate-yaml"] and method == "POST":
                return self._json({"errors": [], "warnings": []})
            if rest[:1] == ["whoami-v2"] and method == "GET":
                return self._json({"type": "user", "name": hub.username, "fullname": hub.username,
                                   "orgs": [], "auth": {"accessToken": {"displayName": "fake-token",
                                                                        "role": "write"}}})
            if rest and rest[0] in REPO_TYPES:
                with hub._lock:
                    repo, tail = self._split_repo(REPO_TYPES[rest[0]], rest[1:])
                    return self._repo_api(method, repo, tail, body)
            raise HubError(404, f"Unknown API route: /{'/'.join(segs)}")
        # Downloads: /{repo_id}/resolve/{rev}/{path} or /{datasets|spaces|kernels}/{repo_id}/resolve/...
        repo_type = "model"
        rest = segs
        if rest and rest[0] in REPO_TYPES and rest[0] != "models":
            repo_type, rest = REPO_TYPES[rest[0]], rest[1:]
        if "resolve" in rest[:3] and method in ("GET", "HEAD"):
            with hub._lock:
                repo, tail = self._split_repo(repo_type, rest)
                if tail[:1] == ["resolve"]:
                    rev, path_segs = self._take_rev(tail[1:])
                    commit = repo.commits[hub._resolve(repo, rev)]
                    path = "/".join(path_segs)
                    data = commit.files.get(path)
            if tail[:1] == ["resolve"]:
                return self._serve_file(commit, path, data)
        raise HubError(404, f"Not found: /{'/'.join(segs)}")

    # -- endpoints ---------------------------------------------------------

    def _create_repo(self, body: bytes) -> None:
        payload = json.loads(body or b"{}")
        name = payload.get("name")
        if not name:
            raise HubError(400, "Missing repo name")
        org = payload.get("organization") or self.hub.username
        repo_id = f"{org}/{name}"
        repo_type = payload.get("type") or "model"
        if repo_type not in URL_PREFIXES:
            raise HubError(400, f"Invalid repo type {repo_type!r}")
        private = payload.get("private")
        if private is None:
            private = payload.get("visibility") == "private"
        with self.hub._lock:
            if (repo_type, repo_id) in self.hub._repos:
                # the client (exist_ok=True) swallows the 409 and then reads "url" from this body
                raise HubError(409, "You already created this model repo",
                               extra={"url": self.hub._repo_url(self.hub._repos[(repo_type, repo_id)])})
            self.hub.create_repo(repo_id, repo_type=repo_type, private=private)
            url = self.hub._repo_url(self.hub._repos[(repo_type, repo_id)])
        self._json({"url": url, "name": repo_id, "id": repo_id})

    def _delete_repo(self, body: bytes) -> None:
        payload = json.loads(body or b"{}")
        org = payload.get("organization") or self.hub.username
        repo_id = f"{org}/{payload.get('name')}"
        with self.hub._lock:
            self.hub.delete_repo(repo_id, repo_type=payload.get("type") or "model")
        self._json({})

    def _repo_api(self, method: str, repo: Repo, tail: list[str], body: bytes) -> None:
        hub = self.hub
        head = tail[0] if tail else ""
        if method == "GET" and not tail:
            commit = repo.commits[hub._resolve(repo, "main")]
            return self._json(hub._info_json(repo, commit, self._qbool("blobs")))
        if method == "GET" and head == "revision":
            rev, _ = self._take_rev(tail[1:])
            commit = repo.commits[hub._resolve(repo, rev)]
            return self._json(hub._info_json(repo, commit, self._qbool("blobs")))
        if method == "GET" and head == "tree":
            rev, path_segs = self._take_rev(tail[1:])
            return self._tree(repo, rev, "/".join(path_segs))
        if method == "POST" and head == "paths-info":
            rev, _ = self._take_rev(tail[1:])
            return self._paths_info(repo, rev, body)
        if method == "POST" and head == "preupload":
            rev, _ = self._take_rev(tail[1:])
            return self._preupload(repo, rev, body)
        if method == "POST" and head == "commit":
            rev, _ = self._take_rev(tail[1:])
            return self._commit(repo, rev, body)
        if method == "GET" and head == "refs":
            return self._refs(repo)
        if method == "GET" and head == "commits":
            rev, _ = self._take_rev(tail[1:])
            return self._commits(repo, rev)
        if head == "branch" and len(tail) >= 2:
            branch = "/".join(tail[1:])
            if method == "POST":
                payload = json.loads(body or b"{}")
                hub.create_branch(repo.repo_id, branch, revision=payload.get("startingPoint") or "main",
                                  repo_type=repo.repo_type)
                return self._json({})
            if method == "DELETE":
                ref = f"refs/heads/{branch}"
                if ref not in repo.refs:
                    raise HubError(404, f"Invalid rev id: {branch}", "RevisionNotFound")
                if branch == "main":
                    raise HubError(403, "Cannot delete the default branch")
                del repo.refs[ref]
                return self._json({})
        if head == "tag" and len(tail) >= 2:
            if method == "POST":
                rev, _ = self._take_rev(tail[1:])
                payload = json.loads(body or b"{}")
                hub.create_tag(repo.repo_id, payload["tag"], revision=rev, repo_type=repo.repo_type)
                return self._json({})
            if method == "DELETE":
                ref = f"refs/tags/{'/'.join(tail[1:])}"
                if ref not in repo.refs:
                    raise HubError(404, f"Invalid rev id: {tail[1]}", "RevisionNotFound")
                del repo.refs[ref]
                return self._json({})
        if head == "discussions":
            return self._discussions(method, repo, tail[1:], body)
        raise HubError(404, f"Unknown repo route: {method} {'/'.join(tail)}")

    def _serve_file(self, commit: Commit, path: str, data: bytes | None) -> None:
        common = {"X-Repo-Commit": commit.oid, "Accept-Ranges": "bytes"}
        if data is None:
            raise HubError(404, f"Entry not found: {path}", "EntryNotFound", headers=common)
        etag = git_blob_sha1(data)
        headers = {**common, "ETag": f'"{etag}"', "Content-Disposition": f'inline; filename="{path.split("/")[-1]}"'}
        rng = self.headers.get("Range")
        if rng and rng.startswith("bytes=") and "," not in rng:
            start_s, _, end_s = rng[len("bytes="):].partition("-")
            try:
                if start_s:
                    start = int(start_s)
                    end = int(end_s) if end_s else len(data) - 1
                else:  # suffix range
                    start, end = max(len(data) - int(end_s), 0), len(data) - 1
            except ValueError:
                start, end = 0, len(data) - 1
            end = min(end, len(data) - 1)
            if start > end or start >= len(data):
                return self._send(416, b"", {**headers, "Content-Range": f"bytes */{len(data)}"})
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            return self._send(206, data[start:end + 1], headers, "application/octet-stream")
        self._send(200, data, headers, "application/octet-stream")

    def _tree(self, repo: Repo, rev: str, path: str) -> None:
        hub = self.hub
        commit = repo.commits[hub._resolve(repo, rev)]
        recursive = self._qbool("recursive")
        expand = self._qbool("expand")
        prefix = path.rstrip("/") + "/" if path else ""
        if path and path in commit.files:
            raise HubError(400, f"{path} is a file, not a folder")
        if path and not any(p.startswith(prefix) for p in commit.files):
            raise HubError(404, f"Entry not found: {path}", "EntryNotFound",
                           headers={"X-Repo-Commit": commit.oid})
        names: set[str] = set()
        for p in commit.files:
            if not p.startswith(prefix):
                continue
            parts = p[len(prefix):].split("/")
            if recursive:
                for i in range(1, len(parts) + 1):
                    names.add(prefix + "/".join(parts[:i]))
            else:
                names.add(prefix + parts[0])
        entries = [hub._tree_entry(repo, commit, n, expand) for n in sorted(names)]
        # directories first, like the Hub
        entries.sort(key=lambda e: (e["type"] != "directory", e["path"]))
        self._json(entries)

    def _paths_info(self, repo: Repo, rev: str, body: bytes) -> None:
        commit = repo.commits[self.hub._resolve(repo, rev)]
        ctype = self.headers.get("Content-Type") or ""
        if "json" in ctype:
            payload = json.loads(body or b"{}")
            paths = payload.get("paths") or []
            expand = bool(payload.get("expand"))
        else:
            form = parse_qs(body.decode(), keep_blank_values=True)
            paths = form.get("paths", [])
            expand = (form.get("expand", ["false"])[0]).lower() in ("1", "true")
        out = []
        for p in paths:
            entry = self.hub._tree_entry(repo, commit, p.strip("/"), expand)
            if entry is not None:
                out.append(entry)
        self._json(out)

    def _preupload(self, repo: Repo, rev: str, body: bytes) -> None:
        payload = json.loads(body or b"{}")
        files = payload.get("files")
        if not isinstance(files, list):
            raise HubError(400, "Invalid preupload payload")
        try:
            current = repo.commits[self.hub._resolve(repo, rev)].files
        except HubError:
            current = {}  # e.g. a branch about to be created: nothing to compare with
        ignore_patterns = _gitignore_patterns(payload.get("gitIgnore"), current.get(".gitignore"))
        out = []
        for f in files:
            path = f["path"]
            existing = current.get(path)
            out.append({
                "path": path,
                "uploadMode": "regular",  # never "lfs": the LFS/Xet path cannot be served locally
                "shouldIgnore": _is_ignored(path, ignore_patterns),
                "oid": git_blob_sha1(existing) if existing is not None else None,
            })
        self._json({"files": out, "commitOid": repo.refs.get("refs/heads/main")})

    def _commit(self, repo: Repo, rev: str, body: bytes) -> None:
        hub = self.hub
        header: dict | None = None
        adds: dict[str, bytes] = {}
        deletes: list[str] = []
        deleted_folders: list[str] = []
        for line in body.splitlines():
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                key, value = item["key"], item["value"]
            except (ValueError, KeyError, TypeError):
                raise HubError(400, "Malformed NDJSON commit payload")
            if key == "header":
                header = value
            elif key == "file":
                content = value.get("content", "")
                if value.get("encoding", "base64") == "base64":
                    try:
                        data = base64.b64decode(content, validate=True)
                    except ValueError:
                        raise HubError(400, f"Invalid base64 content for {value.get('path')!r}")
                else:
                    data = content.encode()
                adds[value["path"]] = data
            elif key == "deletedFile":
                deletes.append(value["path"])
            elif key == "deletedFolder":
                deleted_folders.append(value["path"])
            elif key == "lfsFile":
                raise HubError(400, "LocalHub does not store LFS/Xet files: preupload answers "
                                    "uploadMode='regular' so files must be sent inline")
            else:
                raise HubError(400, f"Unknown commit operation {key!r}")
        if header is None or not header.get("summary"):
            raise HubError(400, "Commit header with a summary is required")
        create_pr = self._qbool("create_pr")
        oid, pr = hub._apply_commit(repo, rev, adds, deletes, deleted_folders, header["summary"],
                                    header.get("description") or "", header.get("parentCommit"),
                                    create_pr=create_pr)
        base_url = hub._repo_url(repo)
        self._json({
            "success": True,
            "commitOid": oid,
            "commitUrl": f"{base_url}/commit/{oid}",
            "pullRequestUrl": f"{base_url}/discussions/{pr.num}" if pr else None,
            "hookOutput": "",
        })

    def _refs(self, repo: Repo) -> None:
        def items(prefix: str) -> list[dict]:
            return [{"name": ref[len(prefix):], "ref": ref, "targetCommit": oid}
                    for ref, oid in sorted(repo.refs.items()) if ref.startswith(prefix)]

        out = {"branches": items("refs/heads/"), "tags": items("refs/tags/"), "converts": []}
        if self._qbool("include_prs"):
            out["pullRequests"] = items("refs/pr/")
        self._json(out)

    def _commits(self, repo: Repo, rev: str) -> None:
        oid = self.hub._resolve(repo, rev)
        out = [{"id": c.oid, "title": c.title, "message": c.message, "date": c.date,
                "authors": [{"user": c.author}]} for c in self.hub._ancestors(repo, oid)]
        self._json(out)

    def _discussions(self, method: str, repo: Repo, tail: list[str], body: bytes) -> None:
        hub = self.hub
        if not tail and method == "POST":
            payload = json.loads(body or b"{}")
            if payload.get("pullRequest"):
                disc = hub._open_pr(repo, payload.get("title") or "", payload.get("description") or "")
            else:
                num = max(repo.discussions, default=0) + 1
                disc = Discussion(num=num, title=payload.get("title") or "", description=payload.get("description") or "",
                                  is_pull_request=False, author=hub.username, created_at=_now_iso(),
                                  base_ref="refs/heads/main", start_oid=None)
                repo.discussions[num] = disc
            return self._json({"num": disc.num, "url": f"{hub._repo_url(repo)}/discussions/{disc.num}",
                               "pullRequest": disc.is_pull_request})
        if not tail and method == "GET":
            discs = [
                {"num": d.num, "title": d.title, "status": d.status, "isPullRequest": d.is_pull_request,
                 "createdAt": d.created_at, "author": {"name": d.author},
                 "repo": {"name": repo.repo_id, "type": repo.repo_type}}
                for d in sorted(repo.discussions.values(), key=lambda d: -d.num)
            ]
            return self._json({"discussions": discs, "count": len(discs), "start": 0,
                               "numClosedDiscussions": 0})
        try:
            num = int(tail[0])
            disc = repo.discussions[num]
        except (ValueError, KeyError, IndexError):
            raise HubError(404, f"Discussion not found: {tail[:1]}")
        action = tail[1] if len(tail) > 1 else ""
        if method == "GET" and not action:
            return self._json(hub._discussion_json(repo, disc))
        if method == "POST" and action == "merge":
            if not disc.is_pull_request or disc.status in ("merged", "closed"):
                raise HubError(400, "This discussion cannot be merged")
            self._merge_pr(repo, disc)
            return self._json({})
        if method == "POST" and action == "status":
            payload = json.loads(body or b"{}")
            disc.status = payload.get("status") or disc.status
            return self._json({"newStatus": {"id": f"st{disc.num}", "type": "status-change",
                                             "createdAt": _now_iso(), "author": {"name": hub.username},
                                             "data": {"status": disc.status}}})
        raise HubError(404, f"Unknown discussion route: {method} {'/'.join(tail)}")

    def _merge_pr(self, repo: Repo, disc: Discussion) -> None:
        """Squash-merge: apply the PR's changes (relative to where it started) onto its base."""
        hub = self.hub
        start = repo.commits[disc.start_oid].files if disc.start_oid else {}
        pr_files = repo.commits[repo.refs[f"refs/pr/{disc.num}"]].files
        adds = {p: b for p, b in pr_files.items() if start.get(p) != b}
        base_files = repo.commits[repo.refs[disc.base_ref]].files
        deletes = [p for p in start if p not in pr_files and p in base_files]
        base_rev = disc.base_ref
        hub._apply_commit(repo, base_rev, adds, deletes, [], f"Merge PR #{disc.num}: {disc.title}", "",
                          None, create_pr=False)
        disc.status = "merged"


# ---------------------------------------------------------------------- helpers


def _gitignore_patterns(*contents: Any) -> list[str]:
    patterns: list[str] = []
    for content in contents:
        if content is None:
            continue
        if isinstance(content, bytes):
            content = content.decode(errors="replace")
        for line in content.splitlines():
            line = line.strip()
            if line and not line.startswith("#") and not line.startswith("!"):
                patterns.append(line)
    return patterns


def _is_ignored(path: str, patterns: list[str]) -> bool:
    name = path.split("/")[-1]
    for pat in patterns:
        pat_clean = pat.strip("/")
        if fnmatch.fnmatch(path, pat_clean) or fnmatch.fnmatch(name, pat_clean):
            return True
        if path.startswith(pat_clean + "/"):
            return True
    return False


def _ensure_no_proxy(host: str) -> None:
    """Make sure HTTP(S)_PROXY settings never capture loopback traffic."""
    for var in ("NO_PROXY", "no_proxy"):
        current = [h.strip() for h in os.environ.get(var, "").split(",") if h.strip()]
        for h in (host, "127.0.0.1", "localhost"):
            if h not in current:
                current.append(h)
        os.environ[var] = ",".join(current)


@contextlib.contextmanager
def hub_offline_mode(offline: bool) -> Iterator[None]:
    """Temporarily set huggingface_hub's offline flag (the constant it read from ``HF_HUB_OFFLINE`` at
    import time) and the environment variable, restoring both afterwards."""
    from huggingface_hub import constants

    old_const = constants.HF_HUB_OFFLINE
    old_env = os.environ.get("HF_HUB_OFFLINE")
    constants.HF_HUB_OFFLINE = offline
    os.environ["HF_HUB_OFFLINE"] = "1" if offline else "0"
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = old_const
        if old_env is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = old_env


class _NoSleepTime(types.ModuleType):
    def __init__(self, real: types.ModuleType):
        super().__init__("time")
        self._real = real

    def sleep(self, seconds: float) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


@contextlib.contextmanager
def no_backoff_sleep() -> Iterator[None]:
    """Make huggingface_hub's HTTP retry backoff (``http_backoff``) not sleep, so tests that inject
    persistent 5xx answers into retried calls (tree listing, ``upload_folder`` commits) stay fast."""
    from huggingface_hub.utils import _http

    real = _http.time
    _http.time = _NoSleepTime(real)
    try:
        yield
    finally:
        _http.time = real
