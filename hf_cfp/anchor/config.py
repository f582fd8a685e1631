"""An anchor's `cfp_config.json`: its name, format version and metadata (small JSON; read without torch, so
that `hf-cfp inspect` summarizes a local anchor without loading torch)."""

import json
import os
import re
from pathlib import Path

from ..errors import AnchorFormatError, AnchorNotFoundError, AnchorValidationError

FORMAT_VERSION = 1
CONFIG_NAME = "cfp_config.json"
MAX_CONFIG_BYTES = 1 << 20


def read_config(path: Path) -> dict:
    """The parsed `cfp_config.json` at `path`: a JSON object with "name" and this library's "format_version"
    (and "metadata"), at most MAX_CONFIG_BYTES.

    Raises:
        AnchorFormatError: too large, not JSON, without those fields, or of another format version (the
            message says what to do).
    """
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise AnchorFormatError(f"{str(path)!r} is over {MAX_CONFIG_BYTES} bytes; an anchor config is small JSON.")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise AnchorFormatError(f"{str(path)!r} is not valid JSON ({error}); re-save the anchor.") from error
    if not isinstance(config, dict) or "name" not in config or "format_version" not in config:
        raise AnchorFormatError(f"{str(path)!r} lacks 'name' or 'format_version'; it was not written by hf-cfp.")
    if config["format_version"] != FORMAT_VERSION:
        raise AnchorFormatError(
            f"{str(path)!r} has format_version {config['format_version']!r}; this hf-cfp reads version "
            f"{FORMAT_VERSION}. Upgrade hf-cfp or re-save the anchor."
        )
    return config


def directory_config(directory: Path) -> dict:
    """The config of the anchor saved in `directory` (`read_config`), after checking there is one.

    Raises:
        AnchorNotFoundError: no such folder, a file, or a folder without `cfp_config.json` (the message says what
            was looked for, and that a local-looking path is never looked up on the Hub).
        AnchorFormatError: as `read_config`.
    """
    if not directory.exists():
        raise AnchorNotFoundError(
            f"No anchor directory at {str(directory)!r}: no such local folder exists (relative paths start "
            f"from {os.getcwd()!r}). Check the path, or save an anchor there with anchor.save_pretrained(). "
            "As it reads as a local path it was not looked up on the Hub; Hub references look like "
            "'org/model:cfp/math'."
        )
    if not directory.is_dir():
        raise AnchorNotFoundError(
            f"No anchor directory at {str(directory)!r}: it is a file; give the folder that holds "
            f"{CONFIG_NAME} and fisher.safetensors."
        )
    if not (directory / CONFIG_NAME).is_file():
        raise AnchorNotFoundError(f"{str(directory)!r} is not an anchor: {CONFIG_NAME} is missing.")
    return read_config(directory / CONFIG_NAME)


_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def validate_anchor_name(name: str) -> str:
    """Anchor names become metric keys and Hub paths: letters, digits, `_`, `.`, `-`; no `..`."""
    if not isinstance(name, str) or not _SAFE_NAME.match(name) or ".." in name:
        raise AnchorValidationError(
            f"Anchor name {name!r} is not allowed: use 1-64 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit and without '..' (e.g. 'math', 'code-v2')."
        )
    return name
