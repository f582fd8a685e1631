"""`python scripts/reproduce_table.py --tiny` end to end (a few minutes on one thread): every arm of the tiny
plan (SFT, DPO and RLOO; diagonal, K-FAC and control methods; the rank and tail sweep) trains and is measured, the
tables and the frontier plot are written, a second call resumes from `results.jsonl` without training again, and
`--list` then has nothing left. Numbers checked: the base row's KL is exactly 0; every seed's unregularized SFT run
learns its task, and its CFP [math] run leaves less than half the math-sensitive drift (lam > 0 reaches the
weights); the drift table's entries are the ratios of the stored DtFD values; a stronger CFP-KFAC [math] leaves a
smaller K-FAC quadratic, and so does a rank-2 truncation with the mean tail against the zero tail (which leaves the
rest free); RLOO with the brevity reward moves the weights, and CFP [math] shrinks their math-sensitive drift."""

import subprocess
from pathlib import Path

import pytest
from support.extras import needs
from support.tiny_runs import result_rows, run_tiny

needs("trl", "datasets")

from evidence.plan import TINY, is_new  # noqa: E402

pytest.importorskip("matplotlib", reason="the frontier plot needs the `demo` extra (matplotlib)")


def run_script(output_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return run_tiny("reproduce_table.py", output_dir, *extra)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("evidence")
    done = run_script(out, "--plot")
    assert done.returncode == 0, done.stderr[-3000:]
    return out, done, result_rows(out)


def test_every_arm_ran_and_the_outputs_are_written(tiny_run):
    out, done, rows = tiny_run
    assert set(rows) == {"base"} | {arm.key for arm in TINY.arms()}
    assert (out / "frontier.png").stat().st_size > 10_000
    report = (out / "evidence.md").read_text()
    for heading in (
        "SFT: quadratic sensitive drift",
        "DPO: quadratic sensitive drift",
        "DPO: task progress",
        "RLOO (pirate reward): task progress",
        "RLOO (brevity reward): quadratic sensitive drift",
        "DPO: CFP-KFAC [math] by rank",
        "SFT: CFP-KFAC [math] by anchor size",
        "Rank and tail sweep: DPO (CFP-KFAC [math], seed 0)",
        "Within 1.25x of full rank's math KL at equal task gain on SFT and DPO",
        "Predicted against measured math KL",
    ):
        assert heading in report
    assert "Traceback" not in done.stderr


def test_the_numbers_hang_together(tiny_run):
    out, _, rows = tiny_run
    assert all(rows["base"]["metrics"][f"{d}/kl"] == 0.0 for d in ("math", "code", "safety"))
    for seed in TINY.seeds:  # later seeds run after DPO arms: a reference model that leaked would stop them training
        unregularized = rows[f"sft/unregularized@0/seed{seed}"]["metrics"]
        protected = rows[f"sft/cfp[math]@{TINY.table_strength:g}/seed{seed}"]["metrics"]
        assert unregularized["task/sft_gain"] > 0.1
        assert protected["math/dtfd"] < 0.5 * unregularized["math/dtfd"]
    # the drift table's CFP [math] cell: mean over seeds of DtFD / DtFD_unregularized - 1
    ratios = [
        rows[f"dpo/cfp[math]@1/seed{s}"]["metrics"]["math/dtfd"]
        / rows[f"dpo/unregularized@0/seed{s}"]["metrics"]["math/dtfd"]
        - 1
        for s in TINY.seeds
    ]
    line = next(
        line
        for line in (out / "evidence.md").read_text().split("### DPO: quadratic")[1].splitlines()
        if line.startswith("| CFP [math] |")
    )
    assert line.split("|")[2].strip().startswith(f"{sum(ratios) / len(ratios):+.0%}")


def test_the_new_arms_hang_together(tiny_run):
    _, _, rows = tiny_run
    new = [arm for arm in TINY.arms() if is_new(arm)]
    assert all(rows[arm.key]["metrics"]["math/kfac_predicted_kl"] >= 0 for arm in new)
    for optimizer in ("sft", "dpo"):  # lam x 10 on the same seed: a smaller K-FAC quadratic of math
        weak, strong = (rows[f"{optimizer}/kfac[math]@{c}/seed0"]["metrics"] for c in (1, 10))
        assert strong["math/kfac_predicted_kl"] < 0.5 * weak["math/kfac_predicted_kl"]
    for optimizer in ("sft", "dpo"):  # the mean tail pulls the directions a zero tail leaves free
        zero, mean, strong = (
            rows[f"{optimizer}/kfac[{a}]@{c}/seed0"]["metrics"]
            for a, c in (("math_r2", 1), ("math_t2", 1), ("math_t2", 10))
        )
        assert strong["math/kfac_predicted_kl"] < 0.5 * zero["math/kfac_predicted_kl"]
        assert strong["math/kfac_predicted_kl"] < 0.5 * mean["math/kfac_predicted_kl"]
        full = mean["kfac/full_floats_per_param"]
        assert zero["kfac/floats_per_param"] < mean["kfac/floats_per_param"] < full  # the tails: 2 floats per weight
    assert rows["sft/kfac[code_t2]@1/seed2"]["metrics"]["kfac/floats_per_param"] > 0  # the default's table rows ran
    free, protected = (rows[f"rloo-brevity/{m}/seed0"]["metrics"] for m in ("unregularized@0", "cfp[math]@1"))
    assert free["math/dtfd"] > 0 and protected["math/dtfd"] < 0.5 * free["math/dtfd"]
    assert "task/brevity_gain" in free and "task/pirate_gain" in free


def test_a_second_call_resumes_without_training(tiny_run):
    out, _, rows = tiny_run
    before = (out / "results.jsonl").read_text()
    again = run_script(out)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (out / "results.jsonl").read_text() == before  # nothing re-run, nothing appended
    assert "Estimating anchor" not in again.stdout  # anchors loaded from the first run
    listed = run_script(out, "--list")
    assert listed.returncode == 0, listed.stderr[-3000:]
    assert f"0 arms to run in {out} ({len(TINY.arms())} done):" in listed.stdout
    assert "0 anchors to make first:" in listed.stdout


def test_report_only_rewrites_the_tables_from_the_results(tiny_run):
    out, _, _ = tiny_run
    report = (out / "evidence.md").read_text()
    (out / "evidence.md").unlink()
    done = run_script(out, "--report-only")
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "evidence.md").read_text() == report
