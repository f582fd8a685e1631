"""Checks of a command's output and anchor paths, run before anything is loaded (no torch here).

Each raises an error of exit code 2 (`cli.failures`) naming the flag and the path, and saying what to give instead.
"""

import os
from pathlib import Path

from ..errors import AnchorNotFoundError, CFPArgumentError


def check_output_directory(path: str, flag: str) -> None:
    """`path` can become a directory written by this process: it is one already or does not exist, and its
    nearest existing parent is a directory this process may write in.

    Raises:
        CFPArgumentError: `path` (or a parent) is a file, or the parent is not writable.
    """
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise CFPArgumentError(f"{flag} {path!r} is a file; give a directory (it is created if missing).")
    parent = target.absolute()
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise CFPArgumentError(f"{flag} {path!r}: {str(parent)!r} is a file, so no directory can be made there.")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CFPArgumentError(f"{flag} {path!r}: no permission to write in {str(parent)!r}; choose another place.")


def check_anchor_directory(path: str) -> None:
    """`path` is a local directory (a command that reads a saved anchor, never the Hub).

    Raises:
        AnchorNotFoundError: no directory there.
    """
    if not os.path.isdir(path):
        raise AnchorNotFoundError(
            f"No anchor directory at {path!r}; give the directory written by `hf-cfp estimate --output` "
            "or `anchor.save_pretrained()` (`hf-cfp pull --output` saves one from the Hub)."
        )


def checked_kfac_rank(args) -> int | None:
    """`--kfac-rank` as `estimate_fisher`'s `kfac_rank`: the integer given, or None for `full` and when not given
    (the caller tells those apart by `args.kfac_rank is None`).

    Raises:
        CFPArgumentError: `--kfac-rank` given with a `--structure` other than kfac.
    """
    if args.kfac_rank is not None and args.structure != "kfac":
        raise CFPArgumentError("--kfac-rank applies to --structure kfac; add --structure kfac, or drop --kfac-rank.")
    return args.kfac_rank if isinstance(args.kfac_rank, int) else None
