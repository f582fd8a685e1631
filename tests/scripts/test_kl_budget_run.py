"""`python scripts/kl_budget_run.py --tiny`: kl_budget in the long run's SFT pipeline on the tiny model. Checked: the
measured KL is logged at every measurement, lam moves from its start by PPO's rule (`--control adaptive`) applied to
the logged KL (an independent replay of the controller), and the held-out checks come at their steps."""

import json

import pytest
from support.extras import needs
from support.tiny_runs import run_tiny

from hf_cfp.integrations.kl_control import controlled_lams

needs("trl", "datasets")


def test_the_tiny_run_logs_every_measurement_and_lam_follows_the_rule(tmp_path):
    done = run_tiny(
        "kl_budget_run.py",
        tmp_path,
        "--steps",
        "8",
        "--every",
        "2",
        "--check-every",
        "4",
        "--budget",
        "0.1",
        "--control",
        "adaptive",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((tmp_path / "kl_budget.json").read_text())
    logged = record["logged"]
    assert [row["step"] for row in logged] == [2, 4, 6, 8]
    assert [check["step"] for check in record["checks"]] == [4, 8]
    lam = record["lam_start"]
    for row in logged:
        (lam,) = controlled_lams([lam], [row["kl"]], [0.1])
        assert row["lam"] == pytest.approx(lam, rel=1e-6)
    assert all(row["kl"] > 0 for row in logged) and "measurements since within 25%" in done.stdout
