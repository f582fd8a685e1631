"""Models named by a Hub id, `org/name[@revision]`: told apart from local paths, and resolved to a commit the way
`from_pretrained` resolves them (`huggingface_hub.hf_hub_download` of `config.json`: the cache first, a cached
file served without the network when `HF_HUB_OFFLINE=1`), with errors that say what to do."""

import os
import re
from pathlib import Path

from huggingface_hub import constants, hf_hub_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from ..anchor.hub import looks_like_local_path
from ..errors import CFPArgumentError, CFPHubError

_HUB_MODEL = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[^@\s]+))?$")


def hub_model_reference(model: str) -> tuple[str, str | None] | None:
    """`(repo_id, revision or None)` when `model` names a Hub model, `org/name` or `org/name@revision` (a branch,
    tag, `refs/pr/N` or commit sha); None when it names a local path: something exists there, or it looks like a
    path (`anchor.hub.looks_like_local_path`: absolute, `./`, `~`, an extension such as `.gguf`, a first segment
    that exists here), or it is not of that form (a bare name such as `mymodel`)."""
    if os.path.exists(model) or looks_like_local_path(model):
        return None
    match = _HUB_MODEL.match(model)
    return None if match is None else (match["repo"], match["revision"])


def resolve_hub_model(repo_id: str, revision: str | None = None, local_files_only: bool = False) -> str:
    """The commit that `revision` (default the repo's default branch) of Hub model `repo_id` names, found as
    `from_pretrained` finds it: `hf_hub_download(repo_id, "config.json", revision=revision)` into the Hugging Face
    cache (a cached file is used as is when offline: `HF_HUB_OFFLINE=1` or `local_files_only`); the snapshot
    folder it lands in is named by the commit.

    Returns:
        `str`: the commit sha (40 hex digits).

    Raises:
        CFPArgumentError: no such repo (or private or gated without a login), no such revision, no `config.json`
            there (not a transformers model), or not in the cache while offline or with the Hub unreachable.
        CFPHubError: the Hub answered with another error (a server error, nothing cached): retry later.
    """
    where = f"{repo_id}@{revision}" if revision else repo_id
    try:
        config = hf_hub_download(repo_id, "config.json", revision=revision, local_files_only=local_files_only)
    except RepositoryNotFoundError:
        raise CFPArgumentError(
            f"Hub model {repo_id!r} not found (or private or gated): check the id (org/name), or log in first "
            "(`hf auth login`) for a private or gated repo."
        ) from None
    except RevisionNotFoundError:
        raise CFPArgumentError(
            f"Hub model {repo_id!r} has no revision {revision!r}: give a branch, tag, refs/pr/N or commit sha."
        ) from None
    except LocalEntryNotFoundError as error:
        if isinstance(error.__cause__, HfHubHTTPError):  # the Hub answered with an error and nothing was cached
            raise CFPHubError(f"The Hub failed to serve {where!r}: {error.__cause__}. Retry later.") from error
        raise CFPArgumentError(_not_cached(repo_id, revision, where, local_files_only)) from None
    except EntryNotFoundError:
        raise CFPArgumentError(
            f"Hub repo {where!r} has no config.json: it is not a transformers model; give a model repo, "
            "a local model directory or a .gguf file."
        ) from None
    except HfHubHTTPError as error:
        raise CFPHubError(f"The Hub failed to serve {where!r}: {error}. Retry later.") from error
    return Path(config).parent.name


def _not_cached(repo_id: str, revision: str | None, where: str, local_files_only: bool) -> str:
    """The message for a model missing from the cache that could not be downloaded: why, and the command to run."""
    download = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
    if constants.HF_HUB_OFFLINE:
        why = "offline mode is on (HF_HUB_OFFLINE=1)"
    elif local_files_only:
        why = "only the cache was to be read (local_files_only, --offline)"
    else:
        why = f"the Hub ({constants.ENDPOINT}) could not be reached"
    return (
        f"Hub model {where!r} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and {why}. "
        f"Download it once with network access (`HF_HUB_OFFLINE=0 {download}`, or run this command with "
        "HF_HUB_OFFLINE=0), or give a local model directory."
    )
