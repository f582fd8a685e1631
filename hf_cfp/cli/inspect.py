"""`hf-cfp inspect`: an anchor's summary from its metadata (`summary`), or with `--full` all of it.

A local anchor directory is summarized from its `cfp_config.json` alone (`anchor.config`: no torch, no
tensor read, well under a second for any size). A Hub reference, or `--full`, goes through
`FisherAnchor.from_pretrained(..., lazy=True)` (reference resolution, download, headers); `--full` then
prints every metadata entry as JSON with `concentration` (top-set shares and mass per module type), which
reads every tensor.
"""

import json
from pathlib import Path

from .. import anchor as anchors  # `anchors.FisherAnchor` imports torch on first use, never for a local summary
from ..anchor.config import CONFIG_NAME, read_config
from .summary import summary_lines


def run(args) -> None:
    """Print the summary of `args.anchor` (a directory or Hub reference), or everything with `args.full`."""
    local_config = Path(args.anchor) / CONFIG_NAME
    if not args.full and local_config.is_file():
        config = read_config(local_config)
        print("\n".join(summary_lines(config["name"], config.get("metadata") or {}, args.anchor)))
        return
    anchor = anchors.FisherAnchor.from_pretrained(
        args.anchor, revision=args.revision, local_files_only=args.offline, lazy=True
    )
    if not args.full:
        print("\n".join(summary_lines(anchor.name, anchor.metadata, args.anchor)))
        return
    print(repr(anchor))
    print(json.dumps({**anchor.metadata, "concentration": anchor.concentration()}, indent=2, sort_keys=True))
