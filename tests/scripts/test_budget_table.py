"""scripts/budget_table.py --tiny end to end: the budget rows against the unregularized run of the same seed."""

import importlib.util
import json
from pathlib import Path

import pytest
from support.extras import needs

needs("trl", "datasets")

from evidence.run import read_results  # noqa: E402

SCRIPT = Path(__file__).parents[2] / "scripts" / "budget_table.py"


def test_budget_table_on_the_tiny_model(tmp_path):
    spec = importlib.util.spec_from_file_location("budget_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "out"
    budgets = [1e9, 0.01, 0.002]
    module.main(
        [
            "--tiny",
            "--scaling",
            "--output-dir",
            str(out),
            "--anchor-dir",
            str(tmp_path / "anchors"),
            "--budgets",
            *map(str, budgets),
        ]
    )
    rows = {row["key"]: row["metrics"] for row in read_results(out / "results.jsonl")}
    free = rows["sft/unregularized@0/seed0"]
    never = rows["sft/budget[math]@1e+09/seed0"]
    assert never == free  # a budget never reached: the same run, bit for bit
    for budget in budgets[1:]:
        assert free["math/predicted_kl"] > budget  # the unprotected path leaves both budgets
        bound = rows[f"sft/budget[math]@{budget:g}/seed0"]
        assert 0.8 * budget <= bound["math/predicted_kl"] <= 1.05 * budget
    # the scaling analysis at s = 1 is the unregularized run again: the same KL on the same base responses, and the
    # diagonal prediction computed directly in float64 equals the callback's logged one
    scaling = json.loads((out / "scaling.json").read_text())
    *scaling, staleness = scaling
    assert [row["scale"] for row in scaling] == [1.0, 0.3, 0.1, 0.03, 0.01]
    assert 0 <= staleness["top1_overlap_now"] < 1  # 6 steps at lr 3e-3 move the tiny model's top set
    assert scaling[0]["measured"] == pytest.approx(free["math/calibration_kl"], rel=1e-4)  # theta0 + (theta - theta0)
    assert scaling[0]["predicted"] == pytest.approx(free["math/predicted_kl"], rel=1e-5)
    assert scaling[-1]["predicted"] == pytest.approx(1e-4 * scaling[0]["predicted"], rel=1e-9)
    text = (out / "budget.md").read_text()
    assert text.count("| CFP predicted_kl_budget [math] |") == 3 and "Spearman" in text and "Staleness" in text
