"""The declaration written out for readers: `documents_options(entries)` ends a class docstring's `Args:` with one
entry per option (what `help()` shows, and the API reference: docs/hf_docstrings.py reads these docstrings from the
imported classes), `option_entries(surface)` gives the entries of a surface's options from
`options.ProtectionOptions`, and `argument_head` and `shown_type` write an entry's first line (`CFPConfig` writes
its `cfp_` keys' with them). The signatures themselves are written out in the source (type checkers read them)."""

import textwrap
from collections.abc import Callable, Sequence
from dataclasses import MISSING, Field
from typing import Any, TypeVar, get_args

from .options import options_on

Class = TypeVar("Class", bound=type)

WIDTH = 119  # the docstrings' line length, as the source's


def documents_options(entries: Sequence[tuple[str, str]]) -> Callable[[Class], Class]:
    """Class decorator: the class docstring's `Args:` section ends with `entries` ((first line, description), as
    `option_entries` gives them), after any entries written there (such as `model`)."""

    def decorate(cls: Class) -> Class:
        cls.__doc__ = with_arguments(cls.__doc__, entries)
        return cls

    return decorate


def option_entries(surface: str) -> list[tuple[str, str]]:
    """The `Args:` entries ((first line, description)) of the options `surface` takes: name, type as shown, default,
    and the declared help."""
    return [(argument_head(f.name, shown_type(f), f.default), f.metadata["help"]) for f in options_on(surface)]


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
