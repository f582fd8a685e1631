"""Skips for tests that need an optional extra (pyproject's `trl`, `peft`, `qlora`, `deepspeed`, `demo`): with only
`pip install -e ".[dev]"` the suite passes, each such test skipped with a reason that names the missing package and
the extra that installs it (`hf_cfp.imports.EXTRA_OF`)."""

import pytest

from hf_cfp.imports import EXTRA_OF, is_available


def reason(*packages: str) -> str:
    """ "needs <missing packages> (pip install 'hf-cfp[<extras>]')" for those of `packages` not installed."""
    missing = [p for p in packages if not is_available(p)]
    extras = ",".join(dict.fromkeys(EXTRA_OF[p] for p in missing))
    return f"needs {' and '.join(missing)} (pip install 'hf-cfp[{extras}]')"


def needs(*packages: str) -> None:
    """Skip the calling test, or at module level the whole module, unless every one of `packages` is installed."""
    __tracebackhide__ = True  # the skip is reported at the caller's line, not here
    if not all(is_available(p) for p in packages):
        pytest.skip(reason(*packages), allow_module_level=True)


def requires(*packages: str) -> pytest.MarkDecorator:
    """A `skipif` mark for a test (or `pytestmark` for a module) that needs `packages`."""
    return pytest.mark.skipif(not all(is_available(p) for p in packages), reason=reason(*packages))
