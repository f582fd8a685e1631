"""The library's own exceptions.

Every message names the parameter, file or argument at fault and says what to do.
They subclass the matching built-in type so generic handlers keep working.
"""


class CFPError(Exception):
    """Base class of every hf-cfp error."""


class CFPArgumentError(CFPError, ValueError):
    """A bad argument: a negative `lam`, a `free_fraction` outside (0, 1), no prompts..."""


class AnchorValidationError(CFPError, ValueError):
    """An anchor's values are unusable: NaN, Inf or negative Fisher entries, a bad name."""


class AnchorMismatchError(CFPError, ValueError):
    """An anchor does not fit the model it is bound to (missing names, other shapes)."""


class AnchorFormatError(CFPError, ValueError):
    """An anchor directory is corrupt, truncated, or of an unknown format version."""


class AnchorNotFoundError(CFPError, FileNotFoundError):
    """No anchor where one was asked for."""


class CFPHubError(CFPError, RuntimeError):
    """The Hub refused or failed a request (server error, permissions, network)."""


class CollectiveDeviceError(CFPError, RuntimeError):
    """Tensors handed to one collective sit on several devices, or on one the process group's backend cannot
    reduce (NCCL reduces CUDA tensors only)."""


def plural(number: int, noun: str, spec: str = "d") -> str:
    """`number` formatted with `spec` (`"d"`, `","`, `"+d"`), then `noun` with an `s` unless |number| is 1:
    `plural(1, "parameter")` is "1 parameter", `plural(3, "anchor")` "3 anchors", `plural(-1, "group", "+d")`
    "-1 group". For the counts in messages."""
    return f"{number:{spec}} {noun}{'' if abs(number) == 1 else 's'}"
