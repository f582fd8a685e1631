"""The declaration written out for readers: `takes_options(surface)` gives a class the signature of its surface's
options (what `inspect.signature` and `help()` show) and one entry per option in its docstring's `Args:`, both
from `options.ProtectionOptions`; `with_arguments` writes such entries (`CFPConfig` writes its `cfp_` keys' too)."""

import inspect
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import MISSING, Field
from typing import Any, TypeVar, get_args

from .options import options_on, signature_of

Class = TypeVar("Class", bound=type)

WIDTH = 119  # the docstrings' line length, as the source's


def takes_options(surface: str) -> Callable[[Class], Class]:
    """Class decorator for a class whose `__init__(self, <leading>, *args, **kwargs)` binds `args` and `kwargs` with
    `ProtectionOptions.given(surface, ...)`: `__init__` gets the signature (self, <leading>, <surface's options>)
    and the class docstring's `Args:` section ends with the options' entries (after any written there, such as
    `model`)."""

    def decorate(cls: Class) -> Class:
        init = vars(cls)["__init__"]
        parameters = list(inspect.signature(init).parameters.values())
        variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        if [p.kind for p in parameters[-2:]] != list(variadic):
            raise TypeError(f"{cls.__name__}.__init__ must end with *args, **kwargs, for ProtectionOptions.given.")
        options = signature_of(surface).parameters.values()
        init.__signature__ = inspect.Signature([*parameters[:-2], *options])
        entries = [(argument_head(f.name, shown_type(f), f.default), f.metadata["help"]) for f in options_on(surface)]
        cls.__doc__ = with_arguments(cls.__doc__, entries)
        return cls

    return decorate


def shown_type(option: Field) -> str:
    """The option's type as the docstrings show it: its `shown_type`, or for `bool`, `int`, `float` and `str`
    (optional or not) the type's name."""
    if option.metadata["shown_type"]:
        return option.metadata["shown_type"]
    plain = [t for t in get_args(option.type) or (option.type,) if t is not type(None)]
    if len(plain) == 1 and plain[0] in (bool, int, float, str):
        return f"`{plain[0].__name__}`"
    raise TypeError(f"Option {option.name!r}: say how the docstrings show its type {option.type} (shown_type=).")


def argument_head(name: str, type_text: str, default: Any) -> str:
    """An HF-style `Args:` entry's first line: `name (type, *optional*, defaults to `default`):`; a required one
    (no default) is not *optional*, and a None default goes unsaid."""
    if default is MISSING:
        return f"{name} ({type_text}):"
    if default is None:
        return f"{name} ({type_text}, *optional*):"
    shown = f'"{default}"' if isinstance(default, str) else repr(default)
    return f"{name} ({type_text}, *optional*, defaults to `{shown}`):"


def with_arguments(doc: str | None, entries: Sequence[tuple[str, str]]) -> str:
    """`doc` with `entries` ((first line, description)) added at the end of its `Args:` section, indented as the
    section is, each description wrapped at `WIDTH`.

    Raises:
        TypeError: `doc` has no `Args:` section.
    """
    if doc is None or "Args:\n" not in doc:
        raise TypeError("A docstring written from the option declaration needs an `Args:` section.")
    start = doc.index("Args:\n")
    indent = " " * (start - doc.rindex("\n", 0, start) - 1 + 4)
    end = doc.find("\n\n", start)
    end = len(doc.rstrip()) if end == -1 else end
    lines = []
    for head, description in entries:
        lines.append(indent + head)
        inner = indent + "    "
        lines.extend(textwrap.wrap(description, WIDTH, initial_indent=inner, subsequent_indent=inner))
    return doc[:end] + "\n" + "\n".join(lines) + doc[end:]
