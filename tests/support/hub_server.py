"""A local, in-memory fake of the Hugging Face Hub, for the calls hf_cfp makes (and nothing more).

`LocalHub` is a stdlib HTTP server (``ThreadingHTTPServer`` on 127.0.0.1, an ephemeral port kept across
``stop()``/``start()``) that the *real* ``huggingface_hub`` client (2.x) talks to. It serves what
``hf_cfp/anchor/hub.py`` uses (``create_repo``, ``list_repo_files``, ``create_commit``, ``snapshot_download``),
through these endpoints, for model repos named ``namespace/name``:

* ``POST /api/repos/create``: a repo starts with one commit holding ``.gitattributes``, like the real Hub; it
  answers 409 with the repo ``url`` in the body when the repo exists (what ``exist_ok=True`` relies on);
  ``private`` is stored and reported by the info endpoint.
* ``GET /api/models/{repo}/revision/{rev}``: ``id``, ``sha`` (the resolved commit), ``private``, ``siblings``.
* ``GET /api/models/{repo}/tree/{rev}``: every file of the revision (path, size, oid), as ``list_repo_files``
  asks (``recursive=true``): no folder entries, no ``path_in_repo``, no paging.
* ``POST /api/models/{repo}/preupload/{rev}``: always ``uploadMode: "regular"`` (contents travel inline,
  base64, in the commit payload: there is no LFS/Xet storage), with the ``oid`` of the file already at that
  path, so the client leaves unchanged files out and makes no commit when nothing changed.
* ``POST /api/models/{repo}/commit/{rev}`` (NDJSON: ``header``, ``file``, ``deletedFile``; any other
  operation is refused with a 400), with ``?create_pr=1``.
* ``HEAD``/``GET /{repo}/resolve/{rev}/{path}``: the bytes, ``X-Repo-Commit`` and an ``ETag`` that is the git
  blob sha1 (what the client's cache keys on).

Revisions are a branch, a tag, ``refs/pr/N`` or a full 40-hex commit sha (URL-encoded by the client).

Semantics. Storage is git-like and linear: a commit is a full snapshot with one parent and a unique sha. A commit
is atomic: it is checked completely (the target ref exists, every deleted file exists) before its ref moves, so a
failed commit changes nothing. ``create_pr`` opens ``refs/pr/N`` (N = 1, 2, ...) at the head of the target branch
and commits there, leaving the branch alone; committing to an existing ``refs/pr/N`` moves only that ref. Errors
carry the Hub's ``X-Error-Code`` (``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``) and
``X-Error-Message`` headers, so the client raises ``RepositoryNotFoundError`` / ``RevisionNotFoundError`` /
``EntryNotFoundError``; any other route answers 404 (e.g. the client's ``/api/agent-harnesses`` probe).

Test hooks. Failures are injected by a substring of the URL-decoded path, answered before any state change:
``fail_next`` (the next matching request), ``fail_always`` (until ``clear_failures``). ``requests`` logs every
request (method, raw path as sent, status). Server-side helpers (no HTTP) seed and inspect the store:
``create_repo``, ``commit`` (to main), ``create_branch``, ``create_tag``, ``resolve``, ``files``, ``refs``,
``history``, ``repo_exists``.

Not covered: dataset/space repos, repo deletion or settings, ``whoami``, ``repo_info`` without a revision,
branch/tag endpoints (seed them server-side), ref and commit listing, tree paths or folder entries,
``get_paths_info``, discussion and pull-request endpoints (a PR is opened only by ``create_pr``, never merged),
``upload_folder``'s multi-commit pipeline, folder deletes (refused), ``parent_commit`` (not checked), LFS/Xet
uploads, ``Range`` requests, short shas, authentication (any token is accepted).

Client-side notes (huggingface_hub 2.4): ``constants.HF_HUB_OFFLINE`` and ``constants.ENDPOINT`` are read at
import time and ``tests/conftest.py`` sets ``HF_HUB_OFFLINE=1``: the ``local_hub`` fixture turns the flag off
(``hub_offline_mode(False)``) and makes the hub the default endpoint (``as_default_endpoint``). The client
retries downloads and preuploads on 5xx with exponential backoff: wrap such injected failures in
``no_backoff_sleep()``.
"""

import base64
import contextlib
import hashlib
import itertools
import json
import os
import threading
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from unittest import mock
from urllib.parse import parse_qs, unquote, urlsplit

__all__ = ["LocalHub", "HubError", "RequestRecord", "git_blob_sha1", "hub_offline_mode", "no_backoff_sleep"]

HOST = "127.0.0.1"
GITATTRIBUTES = (
    b"*.bin filter=lfs diff=lfs merge=lfs -text\n"
    b"*.pt filter=lfs diff=lfs merge=lfs -text\n"
    b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"
)


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a blob (what ``git hash-object`` prints); used as the ETag."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class HubError(Exception):
    """An HTTP error answer (also raised by the server-side helpers, e.g. ``resolve`` of an unknown revision)."""

    def __init__(self, status: int, message: str, code: str | None = None, extra: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code  # X-Error-Code
        self.extra = extra or {}  # more fields for the JSON error body


@dataclass
class Commit:
    oid: str
    parent: str | None
    files: dict[str, bytes]
    title: str


@dataclass
class Repo:
    private: bool
    commits: dict[str, Commit] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)  # full ref name -> commit oid


@dataclass
class RequestRecord:
    method: str
    raw_path: str  # as sent, e.g. ".../revision/refs%2Fpr%2F1"
    status: int


@dataclass
class _Failure:
    substring: str
    status: int
    once: bool


class LocalHub:
    """In-memory fake Hub served over HTTP on 127.0.0.1; see the module docstring for what it covers.

    Usage (or the ``local_hub`` fixture of ``tests/conftest.py``)::

        with LocalHub() as hub:
            HfApi(endpoint=hub.endpoint, token="any").create_repo("org/model", exist_ok=True)
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._repos: dict[str, Repo] = {}
        self._failures: list[_Failure] = []
        self._counter = itertools.count(1)
        self.requests: list[RequestRecord] = []
        self._port = 0
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def endpoint(self) -> str:
        """Base URL to pass as ``endpoint=`` to the client, e.g. ``http://127.0.0.1:41234``."""
        return f"http://{HOST}:{self._port}"

    def start(self) -> "LocalHub":
        """Start serving; after ``stop()``, on the same port with the state kept."""
        _ensure_no_proxy()
        self._server = ThreadingHTTPServer((HOST, self._port), type("_BoundHandler", (_Handler,), {"hub": self}))
        self._server.daemon_threads = True
        self._port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="LocalHub", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving: connections are refused afterwards (the Hub is unreachable)."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
            self._thread.join(timeout=5)

    def __enter__(self) -> "LocalHub":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @contextlib.contextmanager
    def as_default_endpoint(self) -> Iterator["LocalHub"]:
        """Make this hub huggingface_hub's *default* endpoint for the duration (``constants.ENDPOINT`` and
        ``HUGGINGFACE_CO_URL_TEMPLATE``, read at import time, and ``HF_ENDPOINT`` for subprocesses), so that a
        call without ``endpoint=`` lands here, never on huggingface.co. Create ``HfApi()`` inside the block.
        transformers keeps one ``HfApi`` for the process, made at its first Hub call with the endpoint of that
        moment (``transformers.utils.hub.hf_api()``): it starts empty inside the block and is dropped after it, so
        that ``from_pretrained`` in a later test does not call a stopped hub (it retries with backoff for ~90 s)."""
        from huggingface_hub import constants

        template = self.endpoint + "/{repo_id}/resolve/{revision}/{filename}"
        with (
            mock.patch.multiple(constants, ENDPOINT=self.endpoint, HUGGINGFACE_CO_URL_TEMPLATE=template),
            mock.patch("transformers.utils.hub._hf_api", None),
            _setenv("HF_ENDPOINT", self.endpoint),
        ):
            yield self

    # ------------------------------------------------------------------ failure injection

    def fail_next(self, path_substring: str, status: int = 500) -> None:
        """Answer ``status`` to the next request whose URL-decoded path contains ``path_substring``
        (e.g. ``"/commit/"``, ``"/resolve/"``), before it changes anything."""
        with self._lock:
            self._failures.append(_Failure(path_substring, status, once=True))

    def fail_always(self, path_substring: str, status: int = 500) -> None:
        """Like ``fail_next``, for every matching request until ``clear_failures()``."""
        with self._lock:
            self._failures.append(_Failure(path_substring, status, once=False))

    def clear_failures(self) -> None:
        with self._lock:
            self._failures.clear()

    # ------------------------------------------------------------------ server-side helpers (no HTTP)

    def create_repo(self, repo_id: str, *, private: bool = False) -> str:
        """Create a repo (``namespace/name``) holding one commit; returns its sha. 409 if it exists."""
        with self._lock:
            if repo_id in self._repos:
                raise HubError(409, "You already created this model repo", extra={"url": self._url(repo_id)})
            repo = self._repos[repo_id] = Repo(private=private)
            repo.refs["refs/heads/main"] = self._new_commit(
                repo_id, None, {".gitattributes": GITATTRIBUTES}, "initial commit"
            )
            return repo.refs["refs/heads/main"]

    def repo_exists(self, repo_id: str) -> bool:
        with self._lock:
            return repo_id in self._repos

    def commit(self, repo_id: str, files: dict[str, bytes | str], *, message: str = "server-side commit") -> str:
        """Commit to main directly, e.g. to seed a repo or plant a corrupt file; returns the new sha."""
        adds = {path: content.encode() if isinstance(content, str) else content for path, content in files.items()}
        with self._lock:
            return self._apply_commit(repo_id, "main", adds, [], message, create_pr=False)[0]

    def create_branch(self, repo_id: str, branch: str, *, revision: str = "main") -> str:
        return self._create_ref(repo_id, f"refs/heads/{branch}", revision)

    def create_tag(self, repo_id: str, tag: str, *, revision: str = "main") -> str:
        return self._create_ref(repo_id, f"refs/tags/{tag}", revision)

    def resolve(self, repo_id: str, revision: str = "main") -> str:
        """Commit sha of a branch, tag, ``refs/pr/N`` or sha; raises ``HubError`` (404)."""
        with self._lock:
            return self._resolve(self._repo(repo_id), revision)

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        """Snapshot ``{path: content}`` of a revision."""
        with self._lock:
            repo = self._repo(repo_id)
            return dict(repo.commits[self._resolve(repo, revision)].files)

    def refs(self, repo_id: str) -> dict[str, str]:
        """``{"refs/heads/main": sha, "refs/tags/v1": sha, "refs/pr/1": sha, ...}``."""
        with self._lock:
            return dict(self._repo(repo_id).refs)

    def history(self, repo_id: str, revision: str = "main") -> list[dict]:
        """Commits reachable from ``revision``, newest first: ``{"oid", "title"}``."""
        with self._lock:
            repo = self._repo(repo_id)
            out: list[dict] = []
            oid: str | None = self._resolve(repo, revision)
            while oid is not None:
                out.append({"oid": oid, "title": repo.commits[oid].title})
                oid = repo.commits[oid].parent
            return out

    # ------------------------------------------------------------------ store internals (caller holds the lock)

    def _url(self, repo_id: str) -> str:
        return f"{self.endpoint}/{repo_id}"

    def _repo(self, repo_id: str) -> Repo:
        if repo_id not in self._repos:
            raise HubError(404, f"Repository Not Found: {repo_id}", "RepoNotFound")
        return self._repos[repo_id]

    def _resolve(self, repo: Repo, revision: str) -> str:
        for ref in (revision, f"refs/heads/{revision}", f"refs/tags/{revision}"):
            if ref in repo.refs:
                return repo.refs[ref]
        if revision in repo.commits:
            return revision
        raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")

    def _create_ref(self, repo_id: str, ref: str, revision: str) -> str:
        with self._lock:
            repo = self._repo(repo_id)
            repo.refs[ref] = self._resolve(repo, revision)
            return repo.refs[ref]

    def _new_commit(self, repo_id: str, parent: str | None, files: dict[str, bytes], title: str) -> str:
        # Unique across hubs too: the session's Hugging Face cache keys snapshots by commit sha.
        oid = hashlib.sha1(
            f"{repo_id}\0{parent}\0{next(self._counter)}\0{time.time_ns()}\0{title}".encode()
            + b"".join(git_blob_sha1(files[p]).encode() + p.encode() for p in sorted(files))
        ).hexdigest()
        self._repos[repo_id].commits[oid] = Commit(oid, parent, dict(files), title)
        return oid

    def _apply_commit(
        self, repo_id: str, revision: str, adds: dict[str, bytes], deletes: list[str], title: str, create_pr: bool
    ) -> tuple[str, int | None]:
        """Check everything, then move one ref: all or nothing. Returns (sha, PR number or None)."""
        repo = self._repo(repo_id)
        ref = revision if revision.startswith("refs/") else f"refs/heads/{revision}"
        if ref not in repo.refs:
            raise HubError(404, f"Invalid rev id: {revision} (not a branch or refs/pr/N)", "RevisionNotFound")
        head = repo.refs[ref]
        files = dict(repo.commits[head].files)
        for path in deletes:
            if files.pop(path, None) is None:
                raise HubError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
        files.update(adds)
        pr_num = None
        if create_pr:
            pr_num = 1 + sum(r.startswith("refs/pr/") for r in repo.refs)
            ref = f"refs/pr/{pr_num}"
        repo.refs[ref] = self._new_commit(repo_id, head, files, title)
        return repo.refs[ref], pr_num

    # ------------------------------------------------------------------ HTTP routes (caller holds the lock)

    def _handle(self, method: str, segs: list[str], query: dict, body: bytes) -> tuple[bytes, dict, str]:
        """(body, headers, content type) of a 200 answer, or raises ``HubError``."""
        failure = next((f for f in self._failures if f.substring in "/" + "/".join(segs)), None)
        if failure is not None:
            if failure.once:
                self._failures.remove(failure)
            raise HubError(failure.status, f"Injected failure ({failure.status}) for {failure.substring!r}")
        if method == "POST" and segs == ["api", "repos", "create"]:
            payload = json.loads(body)
            repo_id = f"{payload['organization']}/{payload['name']}"
            self.create_repo(repo_id, private=payload.get("visibility") == "private")
            return _json({"url": self._url(repo_id)})
        routes = {
            ("GET", "revision"): self._info,
            ("GET", "tree"): self._tree,
            ("POST", "preupload"): self._preupload,
            ("POST", "commit"): self._commit,
        }
        if segs[:2] == ["api", "models"] and len(segs) == 6 and (method, segs[4]) in routes:
            repo_id, revision = "/".join(segs[2:4]), segs[5]
            return _json(routes[method, segs[4]](repo_id, revision, query, body))
        if method in ("GET", "HEAD") and len(segs) >= 5 and segs[2] == "resolve":
            repo = self._repo("/".join(segs[:2]))
            commit = repo.commits[self._resolve(repo, segs[3])]
            path = "/".join(segs[4:])
            if path not in commit.files:
                raise HubError(404, f"Entry not found: {path}", "EntryNotFound")
            data = commit.files[path]
            headers = {"X-Repo-Commit": commit.oid, "ETag": f'"{git_blob_sha1(data)}"'}
            return data, headers, "application/octet-stream"
        raise HubError(404, f"LocalHub does not serve {method} /{'/'.join(segs)}")

    def _info(self, repo_id: str, revision: str, query: dict, body: bytes) -> dict:
        repo = self._repo(repo_id)
        oid = self._resolve(repo, revision)
        siblings = [{"rfilename": path} for path in sorted(repo.commits[oid].files)]
        return {"id": repo_id, "sha": oid, "private": repo.private, "siblings": siblings}

    def _tree(self, repo_id: str, revision: str, query: dict, body: bytes) -> list[dict]:
        repo = self._repo(repo_id)
        files = repo.commits[self._resolve(repo, revision)].files
        return [
            {"type": "file", "path": path, "size": len(data), "oid": git_blob_sha1(data)}
            for path, data in sorted(files.items())
        ]

    def _preupload(self, repo_id: str, revision: str, query: dict, body: bytes) -> dict:
        repo = self._repo(repo_id)
        current = repo.commits[self._resolve(repo, revision)].files
        out = []
        for f in json.loads(body)["files"]:
            existing = current.get(f["path"])
            oid = None if existing is None else git_blob_sha1(existing)
            out.append({"path": f["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": oid})
        return {"files": out}

    def _commit(self, repo_id: str, revision: str, query: dict, body: bytes) -> dict:
        header: dict = {}
        adds: dict[str, bytes] = {}
        deletes: list[str] = []
        for line in body.splitlines():
            item = json.loads(line)
            key, value = item["key"], item["value"]
            if key == "header":
                header = value
            elif key == "file":
                adds[value["path"]] = base64.b64decode(value["content"])
            elif key == "deletedFile":
                deletes.append(value["path"])
            else:  # e.g. deletedFolder, lfsFile: refuse rather than commit something else than asked
                raise HubError(400, f"LocalHub does not support the commit operation {key!r}")
        create_pr = query.get("create_pr") == ["1"]
        oid, pr_num = self._apply_commit(repo_id, revision, adds, deletes, header["summary"], create_pr)
        return {
            "commitOid": oid,
            "commitUrl": f"{self._url(repo_id)}/commit/{oid}",
            "pullRequestUrl": f"{self._url(repo_id)}/discussions/{pr_num}" if pr_num else None,
        }


def _json(obj: Any) -> tuple[bytes, dict, str]:
    return json.dumps(obj).encode(), {}, "application/json"


class _Handler(BaseHTTPRequestHandler):
    hub: LocalHub  # set on the bound subclass
    # HTTP/1.0: one request per connection, so that stop() really makes the hub unreachable (no
    # keep-alive connection pooled by the client can outlive the server).
    protocol_version = "HTTP/1.0"

    def log_message(self, format: str, *args: Any) -> None:  # no stderr logging
        pass

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        split = urlsplit(self.path)
        segs = [unquote(s) for s in split.path.split("/")[1:]]  # "refs%2Fpr%2F1" stays one segment
        status = 200
        try:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            with self.hub._lock:
                payload, headers, content_type = self.hub._handle(method, segs, parse_qs(split.query), body)
        except Exception as exc:
            err = exc if isinstance(exc, HubError) else HubError(500, f"LocalHub bug: {type(exc).__name__}: {exc}")
            status, content_type = err.status, "application/json"
            payload = json.dumps({**err.extra, "error": err.message}).encode()
            headers = {
                "X-Error-Message": err.message.replace("\n", " "),
                **({"X-Error-Code": err.code} if err.code else {}),
            }
        with self.hub._lock:  # logged before the client can see the answer: its next request is logged after
            self.hub.requests.append(RequestRecord(method, split.path, status))
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        if method != "HEAD":
            self.wfile.write(payload)


def _ensure_no_proxy() -> None:
    """Keep HTTP(S)_PROXY settings from capturing loopback traffic."""
    for var in ("NO_PROXY", "no_proxy"):
        hosts = [h.strip() for h in os.environ.get(var, "").split(",") if h.strip()]
        os.environ[var] = ",".join(hosts + [h for h in (HOST, "localhost") if h not in hosts])


@contextlib.contextmanager
def _setenv(name: str, value: str) -> Iterator[None]:
    """Set one environment variable for the duration, then restore (or remove) it."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


@contextlib.contextmanager
def hub_offline_mode(offline: bool) -> Iterator[None]:
    """Set huggingface_hub's offline flag (the constant it read from ``HF_HUB_OFFLINE`` at import time) and the
    environment variable (for subprocesses) for the duration."""
    from huggingface_hub import constants

    with (
        mock.patch.object(constants, "HF_HUB_OFFLINE", offline),
        _setenv("HF_HUB_OFFLINE", "1" if offline else "0"),
    ):
        yield


def no_backoff_sleep() -> contextlib.AbstractContextManager:
    """Make huggingface_hub's HTTP retry backoff (``http_backoff``) not sleep, so that tests injecting
    persistent 5xx answers into retried calls (downloads, preupload) stay fast."""
    from huggingface_hub.utils import _http

    return mock.patch.object(_http, "time", types.SimpleNamespace(**{**vars(time), "sleep": lambda seconds: None}))
