"""`python scripts/kl_budget_run.py --tiny`: kl_budget in the long run's SFT pipeline on the tiny model. Checked: the
measured KL is logged at every measurement, lam moves from its start by PPO's rule (`--control adaptive`) applied to
the logged KL (an independent replay of the controller), and the held-out checks come at their steps; `--compare`
draws where `--compare-plot` names."""

import json
import subprocess
import sys

import pytest
from support.extras import requires
from support.tiny_runs import SCRIPTS, run_tiny

from hf_cfp.integrations.kl_control import controlled_lams

pytestmark = requires("trl", "datasets")


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


@requires("matplotlib")
def test_compare_draws_where_compare_plot_names(tmp_path):
    record = {
        "budget": 1.0,
        "logged": [{"step": 8, "kl": 0.5, "lam": 2.0}, {"step": 16, "kl": 1.1, "lam": 3.0}],
        "checks": [{"step": 16, "kl": 0.4, "stderr": 0.1, "task_gain": 0.7, "task_gain_stderr": 0.05}],
    }
    runs = [tmp_path / "runs" / name for name in ("a", "b")]
    for run in runs:
        run.mkdir(parents=True)
        (run / "kl_budget.json").write_text(json.dumps(record))
    target = tmp_path / "figure.png"
    command = [sys.executable, str(SCRIPTS / "kl_budget_run.py"), "--compare", *map(str, runs), "--compare-plot"]
    done = subprocess.run([*command, str(target)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"Plot: {target}" in done.stdout
    assert not (tmp_path / "runs" / "compare.png").exists()  # the default place is left as it was
