"""The `hf-cfp` command line: `demo`, `estimate`, `push`, `pull`, `inspect`, `compare`, `diagnose`, `train`.

`parser` declares the commands (and the optional packages each needs: `main` says which extra to install before
importing the command); each runs from its own module (`demo`, `estimate`, `anchors`, `inspect`,
`diagnose`, `train`), imported only when that command runs, so that `hf-cfp --help` and `import hf_cfp.cli` do
not load torch; `failures` turns errors into two lines and an exit code; known noise
of the dependencies is silenced while a command runs (`quiet`). `python -m hf_cfp.cli` runs `main` too (what
`accelerate launch -m hf_cfp.cli estimate ...` needs).
"""

import importlib
from collections.abc import Sequence

from ..imports import require
from ..quiet import known_noise_silenced
from .failures import debug_from_environment, run_reporting_errors
from .parser import build_parser


def main(argv: Sequence[str] | None = None) -> None:
    """Run `hf-cfp` with `argv` (default: the process's arguments).

    Args:
        argv: the arguments after the program name, e.g. `["inspect", "anchors/math"]`.

    Raises:
        SystemExit: 2 for bad arguments or missing input, 1 when the command fails (`failures`), 0 after
            `--help`. A successful command returns None.
    """
    args = build_parser().parse_args(argv)
    debug = getattr(args, "debug", False) or debug_from_environment()
    module_name, function_name = args.handler.split(":")

    def run() -> None:
        require(f"hf-cfp {args.command}", *getattr(args, "needs", ()))  # before the handler's module imports them
        handler = getattr(importlib.import_module(f"{__name__}.{module_name}"), function_name)
        handler(args)

    with known_noise_silenced():  # only while the command runs (`quiet`)
        run_reporting_errors(args.command, run, debug)


__all__ = ["main"]
