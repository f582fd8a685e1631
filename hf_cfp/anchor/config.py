"""An anchor's `cfp_config.json`: its name, format version and metadata (small JSON; read without torch, so
that `hf-cfp inspect` summarizes a local anchor without loading torch)."""

import json
from pathlib import Path

from ..errors import AnchorFormatError

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
