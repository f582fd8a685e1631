"""pytest plugin for scripts/mutation_report.sh (loaded by mutmut through [tool.mutmut] in
pyproject.toml): run a mutant's tests fastest first, by the durations mutmut measured.

mutmut's fork server hands each mutant its covering tests in set order; pytest runs them with -x,
so a killed mutant costs the time up to its first failing test. Fastest first, most mutants die in
a unit test of a few milliseconds instead of after a Trainer run.
"""

import json
from pathlib import Path

import pytest


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    stats = Path("mutmut-stats.json")  # pytest runs in mutants/ under mutmut
    try:
        durations = json.loads(stats.read_text())["duration_by_test"]
    except (OSError, ValueError, KeyError):
        return
    items.sort(key=lambda item: durations.get(item.nodeid, 0.0))
