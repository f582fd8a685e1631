"""Public names imported on first use (module `__getattr__`, PEP 562): a package lists which submodule defines
each name, and none of those submodules (nor torch, which they import) loads until a name is read."""

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The `__getattr__` and `__dir__` of `package` for `exports` (public name -> the submodule, relative to
    `package`, that defines it): reading `package.<name>` imports that submodule and keeps the value in the
    package's namespace, so later reads are plain attribute reads; any other name raises AttributeError."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{exports[name]}", package), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
