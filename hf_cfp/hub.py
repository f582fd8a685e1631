"""Anchors on the Hugging Face Hub: push next to the base model, pull a pinned revision.

A reference names an anchor in a repo: `org/model` (repo root), `org/model:cfp/math`
(a subfolder), `org/model@v1.0:cfp/math` (at a branch, tag, `refs/pr/N` or commit sha).
"""

import posixpath
import re
from pathlib import Path

from huggingface_hub import HfApi, snapshot_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from .errors import AnchorNotFoundError, AnchorValidationError, CFPHubError

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


def parse_reference(reference: str) -> tuple[str, str | None, str]:
    """`org/model@revision:subfolder` -> (repo_id, revision or None, subfolder or "")."""
    match = _REFERENCE.match(reference)
    if match is None:
        raise AnchorValidationError(
            f"{reference!r} is neither a local anchor directory nor a Hub reference like 'org/model:cfp/math' "
            "or 'org/model@revision:cfp/math'."
        )
    return match["repo"], match["revision"], safe_subfolder(match["subfolder"])


def download_anchor(repo_id: str, subfolder: str = "", revision: str | None = None, token=None,
                    cache_dir=None, local_files_only: bool = False, endpoint: str | None = None) -> tuple[Path, str]:
    """Download only the files under `subfolder` at `revision`; returns (local directory, resolved commit).

    Works offline from the cache with `local_files_only=True` or HF_HUB_OFFLINE=1.
    """
    subfolder = safe_subfolder(subfolder)
    where = f"{repo_id}@{revision or 'main'}:{subfolder or '.'}"
    try:
        snapshot = Path(snapshot_download(
            repo_id, revision=revision, allow_patterns=[f"{subfolder}/*"] if subfolder else None,
            cache_dir=cache_dir, local_files_only=local_files_only, token=token, endpoint=endpoint,
        ))
    except RepositoryNotFoundError as error:
        raise AnchorNotFoundError(f"Hub repo {repo_id!r} not found (or private: pass token=). [{where}]") from error
    except RevisionNotFoundError as error:
        raise AnchorNotFoundError(f"Revision {revision!r} not found in {repo_id!r}: use a branch, tag, "
                                  f"refs/pr/N or a commit sha. [{where}]") from error
    except (EntryNotFoundError, LocalEntryNotFoundError) as error:
        raise AnchorNotFoundError(f"No anchor at {where} (offline and not cached, or not on the Hub): "
                                  "check the reference, or go online once to cache it.") from error
    except HfHubHTTPError as error:
        raise CFPHubError(f"The Hub failed to serve {where}: {error}. Retry later; nothing was changed.") from error
    return snapshot / subfolder if subfolder else snapshot, snapshot.name


def push_folder(folder: Path, repo_id: str, path_in_repo: str, revision=None, create_pr=False, commit_message=None,
                private=None, token=None, endpoint=None):
    """create_repo(exist_ok=True), then one commit with every file of `folder` under `path_in_repo`.

    One commit: a failed push leaves the remote as it was.
    """
    api = HfApi(endpoint=endpoint, token=token)
    try:
        api.create_repo(repo_id, exist_ok=True, private=private)
        return api.upload_folder(repo_id=repo_id, folder_path=str(folder), path_in_repo=path_in_repo,
                                 revision=revision, create_pr=create_pr, commit_message=commit_message)
    except HfHubHTTPError as error:
        raise CFPHubError(f"Pushing to {repo_id!r} ({path_in_repo}) failed: {error}. The remote was not changed "
                          "(one commit); check the token's write access and retry.") from error
