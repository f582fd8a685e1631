"""Anchors on the Hugging Face Hub: push next to the base model, pull a pinned revision.

A reference names an anchor in a repo: `org/model` (repo root), `org/model:cfp/math`
(a subfolder), `org/model@v1.0:cfp/math` (at a branch, tag, `refs/pr/N` or commit sha).
"""

import os
import posixpath
import re
from pathlib import Path

from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi, snapshot_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from ..errors import AnchorNotFoundError, AnchorValidationError, CFPHubError

_REFERENCE = re.compile(r"^(?P<repo>[\w.-]+(?:/[\w.-]+)?)(?:@(?P<revision>[^:]+))?(?::(?P<subfolder>.*))?$")


def safe_subfolder(path: str | None) -> str:
    """Normalise a path inside a repo; refuse absolute paths and any `..` that would escape it."""
    if not path:
        return ""
    if path.startswith("/") or "\\" in path:
        raise AnchorValidationError(f"Path in repo {path!r} must be relative, with '/' separators (e.g. 'cfp/math').")
    normal = posixpath.normpath(path)
    if normal == "." or normal.startswith("..") or ".." in normal.split("/"):
        raise AnchorValidationError(f"Path in repo {path!r} escapes the repository; use e.g. 'cfp/math'.")
    return normal


def names_a_local_path(reference: str) -> bool:
    """Whether `reference` can only be a local path (absolute, or starting with "."), never a Hub reference."""
    return os.path.isabs(reference) or reference.startswith(".")


def parse_reference(reference: str) -> tuple[str, str | None, str]:
    """`org/model@revision:subfolder` -> (repo_id, revision or None, subfolder or "")."""
    match = _REFERENCE.match(reference)
    if match is None:
        raise AnchorValidationError(
            f"{reference!r} is neither a local anchor directory nor a Hub reference like 'org/model:cfp/math' "
            "or 'org/model@revision:cfp/math'."
        )
    return match["repo"], match["revision"], safe_subfolder(match["subfolder"])


def download_anchor(
    repo_id: str,
    subfolder: str = "",
    revision: str | None = None,
    token=None,
    cache_dir=None,
    local_files_only: bool = False,
    endpoint: str | None = None,
) -> tuple[Path, str]:
    """Download only the files under `subfolder` at `revision`; returns (local directory, resolved commit).

    Works offline from the cache with `local_files_only=True` or HF_HUB_OFFLINE=1.
    """
    subfolder = safe_subfolder(subfolder)
    where = f"{repo_id}@{revision or 'main'}:{subfolder or '.'}"
    try:
        snapshot = Path(
            snapshot_download(
                repo_id,
                revision=revision,
                allow_patterns=[f"{subfolder}/*"] if subfolder else None,
                cache_dir=cache_dir,
                local_files_only=local_files_only,
                token=token,
                endpoint=endpoint,
            )
        )
    except RepositoryNotFoundError as error:
        raise AnchorNotFoundError(f"Hub repo {repo_id!r} not found (or private: pass token=). [{where}]") from error
    except RevisionNotFoundError as error:
        raise AnchorNotFoundError(
            f"Revision {revision!r} not found in {repo_id!r}: use a branch, tag, refs/pr/N or a commit sha. [{where}]"
        ) from error
    except (EntryNotFoundError, LocalEntryNotFoundError) as error:
        if isinstance(error.__cause__ or error.__context__, HfHubHTTPError):  # a server error, nothing cached
            raise CFPHubError(
                f"The Hub failed to serve {where}: {error.__cause__ or error.__context__}. Retry later."
            ) from error
        raise AnchorNotFoundError(
            f"No anchor at {where} (offline and not cached, or not on the Hub): "
            "check the reference, or go online once to cache it."
        ) from error
    except HfHubHTTPError as error:
        raise CFPHubError(f"The Hub failed to serve {where}: {error}. Retry later; nothing was changed.") from error
    directory = snapshot / subfolder if subfolder else snapshot
    if not directory.is_dir():
        raise AnchorNotFoundError(
            f"{repo_id!r} has no anchor at {subfolder!r} at revision {revision or 'main'} "
            f"(commit {snapshot.name}). [{where}]"
        )
    return directory, snapshot.name


def push_folder(
    folder: Path,
    repo_id: str,
    path_in_repo: str,
    revision=None,
    create_pr=False,
    commit_message=None,
    private=None,
    token=None,
    endpoint=None,
):
    """create_repo(exist_ok=True), then ONE commit (`create_commit`, not the multi-commit upload
    pipeline) adding every file of `folder` under `path_in_repo` and deleting the files left there
    by an earlier push that this one does not rewrite (e.g. old shards). A failed push leaves
    the remote as it was, and with create_pr=True no empty pull request behind."""
    api = HfApi(endpoint=endpoint, token=token)
    target = f"{repo_id}:{path_in_repo}"
    try:
        api.create_repo(repo_id, exist_ok=True, private=private)
        new = {
            f"{path_in_repo}/{p.relative_to(folder).as_posix()}": p for p in sorted(folder.rglob("*")) if p.is_file()
        }
        stale = [f for f in _files_under(api, repo_id, path_in_repo, revision) if f not in new]
        added = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(path)) for name, path in new.items()]
        deleted = [CommitOperationDelete(path_in_repo=name) for name in stale]
        operations: list[CommitOperationAdd | CommitOperationDelete] = [*added, *deleted]
        return api.create_commit(
            repo_id, operations=operations, commit_message=commit_message, revision=revision, create_pr=create_pr
        )
    except HfHubHTTPError as error:
        raise CFPHubError(
            f"Pushing to {target} failed: {error}. The remote was not changed (one commit); "
            "check the token's write access and retry."
        ) from error


def _files_under(api: HfApi, repo_id: str, folder: str, revision) -> list[str]:
    try:
        files = api.list_repo_files(repo_id, revision=revision)
    except RevisionNotFoundError:  # a new branch: nothing to replace
        return []
    return [f for f in files if f.startswith(folder + "/")]
