"""A griffe extension that reads hf-cfp's Hugging Face-style docstrings as Google-style ones (mkdocs.yml loads it).

The package's docstrings follow the convention of transformers, TRL and PEFT: `Args:` items written
`name (type text, *optional*, defaults to `x`):`, `Returns:` items written `` `type`: description ``, and
references written [`Name`], [`~module.Name`] (show the last part only) or [`~Class.method`]. Griffe's Google
parser wants `name: description` with the type taken from the signature, and mkdocs-autorefs wants
`[text][identifier]`. Before the docstrings are parsed, this extension rewrites, in every docstring of the package:

- a reference to a name of the package into `[`Name`][canonical.path]`, the path of the object that defines it
  (found in the scope of the docstring's object, then in the package's top-level names); mkdocs-autorefs links it
  to the object's entry in the API reference, and `mkdocs build --strict` fails when that entry does not exist;
- a reference to another library (`transformers`, `trl`, ...) into plain code, `` `Name` `` (the docs are built
  offline: no other project's inventory is fetched);
- a reference it cannot resolve into `[`Name`][Name]`, which autorefs reports and strict mode fails on;
- an `Args:` item's type text into the start of its description, `name: (type text) description`, so that the
  type column shows the signature's annotation; an item naming several arguments (`a, b: as in ...`) into one
  item per argument;
- a `Returns:` item's type into a bare expression (`FisherAnchor: ...`, `list[float]: ...`), which griffe parses
  and links.

Griffe reads the source (static analysis: the package is not imported to be documented), with one exception: a class
decorated with `documents_options(...)` (`CFPCallback`, `CFP`, `CFPConfig`) has the `Args:` entries of its
options written into its docstring at import, from their one declaration (`hf_cfp.integrations.options`); its
docstring is read from the imported class. Its signature is still read from the source, where it is written out.
"""

import inspect
import re
from functools import partial

import griffe

# [`Name`], [`~a.b.Name`], [`~Class.method`]: HF doc-builder's reference syntax (not followed by [ or ( already)
REFERENCE = re.compile(r"\[`(~?)([A-Za-z_][\w.]*)`\](?![\[(])")
SECTION = re.compile(r"^(\s*)(Args|Arguments|Parameters|Returns|Raises|Example|Examples|Yields|Attributes):\s*$")
ARG_ITEM = re.compile(r"^(\s*)([A-Za-z_*][\w*]*(?:\s*,\s*[A-Za-z_*][\w*]*)*)\s*(?:\((.*)\))?:(.*)$")
NAMES_WRAPPED = re.compile(r"^\s*[A-Za-z_][\w]*(?:\s*,\s*[A-Za-z_][\w]*)*,\s*$")  # `a, b, c,` then `d: ...`
RETURN_ITEM = re.compile(r"^(\s*)(?:\[`([^`]+)`\]|`([^`]+)`):(.*)$")  # [`Type`]: ... or `type`: ...
# The class decorator that writes a docstring's Args: from the option declaration at import (integrations.surfaces)
DECLARED = "documents_options"


class HFStyleDocstrings(griffe.Extension):
    """Rewrite every docstring of the package once it is loaded (names then resolve across modules)."""

    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        for obj in _objects(pkg):
            if obj.docstring is not None and obj.is_class and any(_calls(d.value, DECLARED) for d in obj.decorators):
                obj.docstring.value = inspect.cleandoc(griffe.dynamic_import(obj.path).__doc__)
            if obj.docstring is not None:
                text = _sections(obj.docstring.value)
                obj.docstring.value = REFERENCE.sub(partial(_reference, pkg, obj), text)


def _calls(decorator: str | griffe.Expr, name: str) -> bool:
    """Whether a decorator expression is a call of the function `name` (`name(...)`, `module.name(...)`)."""
    return str(decorator).partition("(")[0].rpartition(".")[2] == name


def _objects(obj: griffe.Object):
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _objects(member)


def _reference(pkg: griffe.Module, obj: griffe.Object, match: re.Match) -> str:
    short, dotted = match.group(1) == "~", match.group(2)
    shown = dotted.rsplit(".", 1)[-1] if short else dotted
    path = _resolve(pkg, obj, dotted)
    if path is None:
        return f"[`{shown}`][{dotted}]"  # unresolved: autorefs reports it, strict mode fails
    if path.split(".", 1)[0] != pkg.name:
        return f"`{shown}`"  # another library's object
    return f"[`{shown}`][{path}]"


def _resolve(pkg: griffe.Module, obj: griffe.Object, dotted: str) -> str | None:
    """The canonical path of `dotted` seen from `obj` (its scope, then the package's top level), or None."""
    head, _, rest = dotted.partition(".")
    if head != pkg.name:
        for scope in (obj, pkg):
            try:
                path = scope.resolve(head)
            except griffe.NameResolutionError:
                continue
            return _canonical(pkg, f"{path}.{rest}" if rest else path)
        if "." not in dotted:
            return None
        return dotted  # a dotted path outside the package's names: another library's
    return _canonical(pkg, dotted)


def _canonical(pkg: griffe.Module, path: str) -> str | None:
    if path.split(".", 1)[0] != pkg.name:
        return path
    try:
        target = pkg.modules_collection.get_member(path)
        return target.final_target.path if target.is_alias else target.path
    except (KeyError, ValueError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        return None


def _sections(text: str) -> str:
    """HF-style `Args:` and `Returns:` items in Google style (the item lines only; descriptions are kept)."""
    out: list[str] = []
    section, item_indent, names = None, None, ""
    for line in text.splitlines():
        if names:  # the rest of a list of argument names wrapped onto this line
            line, names = names + line.lstrip(), ""
        header = SECTION.match(line)
        if header:
            section, item_indent = header.group(2), None
            out.append(line)
            continue
        if line.strip() and item_indent is None and section is not None:
            item_indent = len(line) - len(line.lstrip())
        at_item = line.strip() and section is not None and len(line) - len(line.lstrip()) == item_indent
        if at_item and section in ("Args", "Arguments", "Parameters") and NAMES_WRAPPED.match(line):
            names = line.rstrip() + " "
        elif at_item and section in ("Args", "Arguments", "Parameters"):
            out.extend(_arg_item(line))
        elif at_item and section == "Returns":
            out.append(_return_item(line))
        else:
            if line.strip() and section is not None and len(line) - len(line.lstrip()) < (item_indent or 0):
                section = None  # the section ended: back to the docstring's body
            out.append(line)
    return "\n".join(out)


def _arg_item(line: str) -> list[str]:
    match = ARG_ITEM.match(line)
    if match is None:
        return [line]
    indent, names, type_text, rest = match.groups()
    description = f"({type_text}) {rest.strip()}".rstrip() if type_text else rest.strip()
    return [f"{indent}{name.strip()}: {description}" for name in names.split(",")]


def _return_item(line: str) -> str:
    match = RETURN_ITEM.match(line)
    if match is None:
        return line
    indent, reference, code, rest = match.groups()
    return f"{indent}{reference or code}:{rest}"
