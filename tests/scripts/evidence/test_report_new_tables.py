"""The report's tables for the K-FAC and RL arms, on hand-made result rows: the rank and anchor-size sweeps (first
seed, table strength, relative DtFD against the unregularized run), predicted against measured math KL (means
over seeds), the RL optimizers' tables (the reward gain as task progress) and the frontier curves of CFP-KFAC.
Expected cells are written out by hand."""

from support.extras import needs

needs("trl", "datasets")

from evidence.plan import DOMAINS, EMBEDDED, Arm  # noqa: E402
from evidence.report import (  # noqa: E402
    capability_table,
    drift_table,
    frontier_points,
    markdown_report,
    prediction_table,
    rank_labels,
    size_labels,
    sweep_table,
)


def _row(optimizer, method, strength, seed, anchor, dtfd, kl=0.0, task=0.0, predicted=None):
    arm = Arm(optimizer, method, strength, seed, anchor)
    metrics = {f"{d}/dtfd": dtfd for d in DOMAINS} | {f"{d}/kl": kl + i for i, d in enumerate(DOMAINS)}
    metrics |= {"task/sft_gain": task, "task/dpo_margin": task, "task/pirate_gain": task, "task/brevity_gain": task}
    if predicted is not None:
        metrics["math/kfac_predicted_kl"] = predicted
    return {"key": arm.key, "arm": arm.__dict__, "metrics": metrics}


def test_the_sweep_labels_follow_the_plan():
    assert rank_labels(EMBEDDED) == {
        "math_r8": "CFP-KFAC [math] rank 8",
        "math_r64": "CFP-KFAC [math] rank 64",
        "math": "CFP-KFAC [math] full",
    }
    assert list(size_labels(EMBEDDED).items()) == [
        ("math_n16", "CFP-KFAC [math] 16 sequences"),
        ("math", "CFP-KFAC [math] 32 sequences"),
        ("math_n64", "CFP-KFAC [math] 64 sequences"),
        ("math_n128", "CFP-KFAC [math] 128 sequences"),
    ]


def test_sweep_table_is_relative_to_the_first_seeds_unregularized_run():
    rows = [
        _row("sft", "unregularized", 0.0, 0, None, 2.0, kl=5.0, task=2.0),
        _row("sft", "kfac", 1.0, 0, "math", 0.5, kl=1.0, task=1.5, predicted=0.1),  # -75%
        _row("sft", "kfac", 1.0, 0, "math_r8", 1.5, kl=4.0, task=1.9, predicted=0.3),  # -25%
        _row("sft", "kfac", 10.0, 0, "math", 0.1, kl=0.5, task=1.0, predicted=0.01),  # another strength
        _row("sft", "kfac", 1.0, 1, "math_r8", 9.0, kl=9.0, task=9.0, predicted=9.0),  # another seed
        _row("dpo", "kfac", 1.0, 0, "math_r8", 9.0, kl=9.0, task=9.0, predicted=9.0),  # another optimizer
    ]
    lines = sweep_table(rows, "sft", rank_labels(EMBEDDED), 1.0, 0).splitlines()
    assert lines[0] == "| SFT arm | task/sft_gain | math KL | code KL | safety KL | math DtFD | K-FAC math pred. KL |"
    assert lines[2:] == [
        "| unregularized | 2 | 5 | 6 | 7 | (abs. 2) |  |",
        "| CFP-KFAC [math] rank 8 | 1.9 | 4 | 5 | 6 | -25% | 0.3 |",  # rank 64 did not run: left out
        "| CFP-KFAC [math] full | 1.5 | 1 | 2 | 3 | -75% | 0.1 |",
    ]


def test_prediction_table_averages_over_seeds_the_arms_that_have_a_kfac_prediction():
    rows = [
        {"key": "base", "metrics": {"math/kl": 0.0}},
        _row("sft", "unregularized", 0.0, 0, None, 2.0, kl=5.0),  # no K-FAC prediction: left out
        _row("sft", "kfac", 1.0, 0, "math", 0.4, kl=2.0, predicted=0.1),
        _row("sft", "kfac", 1.0, 1, "math", 0.6, kl=4.0, predicted=0.3),
        _row("rloo-brevity", "cfp", 1.0, 0, "math", 0.02, kl=0.5, predicted=0.04),
    ]
    assert prediction_table(rows).splitlines()[2:] == [
        "| SFT CFP-KFAC [math] c=1 | 0.25 | 0.2 | 3 |",  # 0.5 * mean(0.4, 0.6), mean(0.1, 0.3), mean(2, 4)
        "| RLOO (brevity reward) CFP [math] c=1 | 0.01 | 0.04 | 0.5 |",
    ]


def test_rl_tables_use_the_reward_gain_and_leave_cells_blank_when_the_optimizer_never_moved():
    rows = [
        {"key": "base", "metrics": {"math/kl": 0.0}},
        _row("rloo-pirate", "unregularized", 0.0, 0, None, 0.0, kl=0.0, task=0.0),
        _row("rloo-pirate", "kfac", 1.0, 0, "math", 0.0, kl=0.0, task=0.0),
        _row("rloo-brevity", "unregularized", 0.0, 0, None, 4.0, kl=2.0, task=0.8),
        _row("rloo-brevity", "kfac", 1.0, 0, "math", 1.0, kl=1.0, task=0.5),
    ]
    pirate = drift_table(rows, "rloo-pirate", lambda arm: True).splitlines()
    assert pirate[0] == "| RLOO (pirate reward) arm | math DtFD | code DtFD | safety DtFD |"
    assert pirate[3] == "| CFP-KFAC [math] |  |  |  |"  # DtFD 0 / 0: no ratio
    assert (
        drift_table(rows, "rloo-brevity", lambda arm: True).splitlines()[3]
        == "| CFP-KFAC [math] | -75% | -75% | -75% |"
    )
    brevity = capability_table(rows, "rloo-brevity", lambda arm: True).splitlines()
    assert brevity[0].startswith("| RLOO (brevity reward) arm | task/brevity_gain | math KL | code KL | safety KL |")
    assert [c.strip() for c in brevity[4].split("|")[1:6]] == ["CFP-KFAC [math]", "0.5", "1", "2", "3"]


def test_frontier_has_a_cfp_kfac_curve_and_the_report_has_every_section():
    rows = [
        {"key": "base", "metrics": {"math/kl": 0.0}},
        _row("sft", "unregularized", 0.0, 0, None, 1.0, kl=5.0, task=2.0),
        _row("sft", "kfac", 10.0, 0, "math", 0.1, kl=1.0, task=1.0, predicted=0.01),
        _row("sft", "kfac", 1.0, 0, "math", 0.5, kl=3.0, task=1.5, predicted=0.1),
        _row("sft", "kfac", 1.0, 0, "math_r8", 0.5, kl=4.0, task=1.8, predicted=0.2),  # a sweep: not a method curve
        _row("sft", "cfp", 1.0, 0, "math", 0.5, kl=4.5, task=1.7),
    ]
    curves = frontier_points(rows, "sft", (None, "math"), {0})
    assert curves == {"CFP [math]": [(5.0, 2.0), (4.5, 1.7)], "CFP-KFAC [math]": [(5.0, 2.0), (3.0, 1.5), (1.0, 1.0)]}
    report = markdown_report(rows, EMBEDDED)
    for heading in (
        "### SFT: quadratic sensitive drift",
        "### SFT: CFP-KFAC [math] by rank (c = 1, seed 0)",
        "### SFT: CFP-KFAC [math] by anchor size (c = 1, seed 0)",
        "### Predicted against measured math KL (nats)",
    ):
        assert heading in report
    assert "### DPO" not in report and "### RLOO" not in report  # optimizers without rows get no section
    assert "### Rank and tail sweep: SFT" in report and "### Rank and tail sweep: DPO" not in report
