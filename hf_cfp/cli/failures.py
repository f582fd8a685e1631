"""How a command's errors reach the user: one line saying what was wrong, one saying what to do, an exit code.

    EXIT_USAGE (2)    bad arguments or input: `CFPArgumentError`, `AnchorNotFoundError`, a missing file or
                      directory, an input file that is not valid JSON (argparse's own errors exit 2 too);
    EXIT_FAILURE (1)  the command failed: any other `CFPError` (corrupt anchor, mismatch, Hub refusal), a
                      permission or other OS error, a ValueError raised while running.

Anything else is a bug and keeps Python's traceback. With `--debug` or `HF_CFP_DEBUG=1` the traceback of a
handled error is printed too, above the same two lines, and the exit code is the same.
"""

import json
import os
import sys
import traceback
from collections.abc import Callable

from ..errors import AnchorNotFoundError, CFPArgumentError, CFPError

EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report Ctrl-C

USAGE_ERRORS = (CFPArgumentError, AnchorNotFoundError, FileNotFoundError, NotADirectoryError, json.JSONDecodeError)
FAILURES = (CFPError, OSError, ValueError)


def debug_from_environment() -> bool:
    """Whether HF_CFP_DEBUG asks for tracebacks ("1", "true", "yes" or "on", any case)."""
    return os.environ.get("HF_CFP_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")


def describe(error: BaseException) -> str:
    """What was wrong, in one line: the library's own message, or the OS error with its path."""
    if isinstance(error, CFPError):
        return str(error)
    if isinstance(error, json.JSONDecodeError):
        return f"an input file is not valid JSON ({error})"
    if isinstance(error, OSError) and error.filename is not None:
        return f"{error.strerror or type(error).__name__}: {os.fsdecode(error.filename)!r}"
    return f"{type(error).__name__}: {error}"


def exit_code(error: BaseException) -> int:
    """`EXIT_USAGE` for bad arguments or missing input, else `EXIT_FAILURE`."""
    return EXIT_USAGE if isinstance(error, USAGE_ERRORS) else EXIT_FAILURE


def run_reporting_errors(command: str, run: Callable[[], None], debug: bool) -> None:
    """Call `run()`; on an error of `FAILURES` (or Ctrl-C) print what was wrong and what to do to stderr and
    exit with its code (module docstring). Other exceptions propagate with their traceback.

    Args:
        command: the command's name, for the messages (`hf-cfp <command>: error: ...`).
        run: the command, arguments bound.
        debug: also print the traceback of a handled error.

    Raises:
        SystemExit: with `EXIT_USAGE`, `EXIT_FAILURE` or `EXIT_INTERRUPTED` after an error.
    """
    prog = f"hf-cfp {command}"
    try:
        run()
    except KeyboardInterrupt:
        sys.stderr.write(f"{prog}: interrupted.\n")
        raise SystemExit(EXIT_INTERRUPTED) from None
    except FAILURES as error:
        if debug:
            traceback.print_exc()
        code = exit_code(error)
        hint = (
            f"Check the arguments and paths (`{prog} --help` lists the options)."
            if code == EXIT_USAGE
            else "Add --debug (or set HF_CFP_DEBUG=1) to see the traceback."
        )
        sys.stderr.write(f"{prog}: error: {describe(error)}\n{hint}\n")
        raise SystemExit(code) from None
