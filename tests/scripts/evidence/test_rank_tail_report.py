"""The report's rank and tail sweep on hand-made result rows: the math KL at equal task gain (log KL interpolated
linearly in task progress between consecutive strengths, never extrapolated), its ratio to full rank's, the table's
cells ("—" for arms not run, "n/a" outside a sweep) and the sentence that names the smallest rank and trace share
within 1.25x on both optimizers. Expected numbers are computed by hand in the comments."""

import math
from dataclasses import replace

import pytest
from support.extras import needs

needs("trl", "datasets")

from evidence.plan import DOMAINS, EMBEDDED, Arm  # noqa: E402
from evidence.report import (  # noqa: E402
    equal_gain,
    kl_at_gain,
    lower_bounds,
    markdown_report,
    rank_tail_rule,
    rank_tail_table,
    truncation_labels,
)

PLAN = replace(EMBEDDED, kfac_tail_ranks=(8, 64), kfac_shares=(90,), truncation_strengths=())


def test_interpolation_is_linear_in_log_kl_between_consecutive_strengths():
    points = [(4.0, 8.0), (2.0, 2.0), (1.0, 0.5)]  # (task progress, math KL), c = 1, 10, 100
    assert kl_at_gain(points, 3.0) == pytest.approx(4.0)  # halfway: sqrt(8 * 2)
    assert kl_at_gain(points, 3.5) == pytest.approx(2**2.5)  # a quarter: 8^0.75 2^0.25
    assert kl_at_gain(points, 1.5) == pytest.approx(1.0)  # the second segment: sqrt(2 * 0.5)
    assert kl_at_gain(points, 2.0) == 2.0  # a point itself
    assert kl_at_gain(points, 4.5) is None and kl_at_gain(points, 0.5) is None  # no extrapolation
    assert kl_at_gain([(4.0, 8.0)], 3.0) is None  # one point brackets nothing
    assert kl_at_gain([(4.0, 8.0), (2.0, -0.1)], 3.0) is None  # a KL <= 0 has no log
    assert kl_at_gain([(2.0, 2.0), (4.0, 8.0)], 3.0) == pytest.approx(4.0)  # task progress may rise with c


def _row(optimizer, c, anchor, task, kl, stderr=None, method="kfac", seed=0, **extra):
    arm = Arm(optimizer, method, c, seed, anchor)
    task_key = "task/sft_gain" if optimizer == "sft" else "task/dpo_margin"
    metrics = {f"{d}/{name}": 1.0 for d in DOMAINS for name in ("kl", "dtfd")}  # what the other tables read
    metrics |= {"math/kl": kl, task_key: task, **({"math/kl_stderr": stderr} if stderr is not None else {}), **extra}
    return {"key": arm.key, "arm": arm.__dict__, "metrics": metrics}


def _rows(dpo_share_kl: float = 0.12) -> list[dict]:
    return [
        {"key": "base", "metrics": {"math/kl": 0.0}},
        _row("sft", 0.0, None, 4.0, 20.0, method="unregularized"),
        _row("dpo", 0.0, None, 40.0, 1.0, method="unregularized"),
        _row("sft", 0.0, None, 4.0, 20.0, method="unregularized", seed=1),
        _row("sft", 1.0, "math", 3.0, 2.0, stderr=0.1),
        _row("sft", 10.0, "math", 2.0, 0.5),
        _row("sft", 100.0, "math", 1.0, 0.1),
        _row("sft", 1.0, "math_t8", 3.5, 6.0),  # at 3: sqrt(6 * 1.5) = 3, ratio 3 / 2
        _row("sft", 10.0, "math_t8", 2.5, 1.5),
        _row("sft", 1.0, "math_r8", 4.0, 16.6),  # one point: n/a
        _row("sft", 1.0, "math_t64", 3.5, 4.0, **{"kfac/floats_per_param": 0.3, "kfac/full_floats_per_param": 3.04}),
        _row("sft", 10.0, "math_t64", 2.5, 1.0),  # sqrt(4 * 1) = 2: ratio 1
        _row("sft", 1.0, "math_r64", 3.5, 9.0),
        _row("sft", 10.0, "math_r64", 2.5, 4.0),  # sqrt(9 * 4) = 6: ratio 3
        _row("sft", 1.0, "math_s90", 3.5, 2.25),
        _row("sft", 10.0, "math_s90", 2.5, 1.0),  # sqrt(2.25 * 1) = 1.5: ratio 0.75
        _row("sft", 1.0, "math_s90", 9.0, 9.0, seed=1),  # another seed: left out
        _row("dpo", 1.0, "math", 20.0, 0.1),
        _row("dpo", 1.0, "math_t8", 30.0, 0.4),  # both above 20: n/a
        _row("dpo", 10.0, "math_t8", 22.0, 0.2),
        _row("dpo", 1.0, "math_t64", 24.0, 0.2),
        _row("dpo", 10.0, "math_t64", 16.0, 0.05),  # sqrt(0.2 * 0.05) = 0.1: ratio 1
        _row("dpo", 1.0, "math_s90", 22.0, dpo_share_kl),
        _row("dpo", 10.0, "math_s90", 18.0, dpo_share_kl),  # the same KL: ratio dpo_share_kl / 0.1
    ]


def test_the_ratio_to_full_rank_at_its_task_gain():
    target, found = equal_gain(_rows(), PLAN, "sft")
    assert target == 3.0
    assert found["math"] == (2.0, 1.0)
    assert found["math_t8"][0] == pytest.approx(3.0) and found["math_t8"][1] == pytest.approx(1.5)
    assert found["math_r8"] == (None, None)
    assert found["math_s90"][1] == pytest.approx(0.75)  # seed 1's row left out
    assert "math_t64" in found and set(found) == set(truncation_labels(PLAN))
    target, found = equal_gain(_rows(), PLAN, "dpo")
    assert target == 20.0 and "math_r64" not in found and found["math_t8"] == (None, None)
    assert found["math_s90"][1] == pytest.approx(1.2)


def test_a_weaker_truncation_strength_is_interpolated_with_its_neighbour_in_strength_order():
    plan = replace(PLAN, truncation_strengths=(0.3,))
    assert plan.sweep_strengths() == (0.3, 1.0, 10.0, 100.0)
    rows = _rows() + [_row("sft", 0.3, "math_t64", 4.5, 16.0)]  # c = 0.3 and c = 1 bracket 3 no more than before
    rows += [_row("sft", 0.3, "math_r8", 2.0, 4.0)]  # (2, 4) then (4, 16.6): at 3, sqrt(4 * 16.6)
    _, found = equal_gain(rows, plan, "sft")
    assert found["math_t64"][0] == pytest.approx(2.0)  # still c = 1 and c = 10: sqrt(4 * 1)
    assert found["math_r8"][0] == pytest.approx(math.sqrt(4 * 16.6))
    header = rank_tail_table(rows, plan, "sft").splitlines()[0]
    assert header.startswith("| SFT truncation | floats/param | c=0.3 math KL | c=0.3 task/sft_gain | c=1 math KL")


def test_the_table_has_a_row_per_truncation_and_dashes_for_what_did_not_run():
    lines = rank_tail_table(_rows(), PLAN, "sft").splitlines()
    assert lines[0] == (
        "| SFT truncation | floats/param | c=1 math KL | c=1 task/sft_gain | c=10 math KL | c=10 task/sft_gain | "
        "c=100 math KL | c=100 task/sft_gain | math KL at task/sft_gain = 3 | ratio to full |"
    )
    assert lines[2:] == [
        "| full rank | 3.04 | 2 ± 0.1 | 3 | 0.5 | 2 | 0.1 | 1 | 2 | 1.00 |",
        "| rank 8, mean tail | — | 6 | 3.5 | 1.5 | 2.5 | — | — | 3 | 1.50 |",
        "| rank 8, zero tail | — | 16.6 | 4 | — | — | — | — | n/a | n/a |",
        "| rank 64, mean tail | 0.3 | 4 | 3.5 | 1 | 2.5 | — | — | 2 | 1.00 |",
        "| rank 64, zero tail | — | 9 | 3.5 | 4 | 2.5 | — | — | 6 | 3.00 |",
        "| 90% of trace, mean tail | — | 2.25 | 3.5 | 1 | 2.5 | — | — | 1.5 | 0.75 |",
    ]
    dpo = rank_tail_table(_rows(), PLAN, "dpo").splitlines()
    assert dpo[6] == "| rank 64, zero tail | — | — | — | — | — | — | — | — | — |"
    assert dpo[3] == "| rank 8, mean tail | — | 0.4 | 30 | 0.2 | 22 | — | — | n/a | n/a |"
    # no full-rank row yet: nothing to compare with
    partial = [r for r in _rows() if r.get("arm", {}).get("anchor") != "math"]
    lines = rank_tail_table(partial, PLAN, "sft").splitlines()
    assert lines[0].endswith("| math KL at full rank's c=1 task/sft_gain | ratio to full |")
    assert lines[3].endswith("| 6 | 3.5 | 1.5 | 2.5 | — | — | — | — |")


def test_the_rule_names_the_smallest_rank_and_share_within_1_25_on_both_optimizers():
    # t8: 1.5 (SFT), n/a (DPO); r8: n/a; t64: 1, 1; r64: 3, not run; s90: 0.75, 1.2
    assert rank_tail_rule(_rows(), PLAN) == (
        "Within 1.25x of full rank's math KL at equal task gain on SFT and DPO: the smallest absolute rank is 64 "
        "(mean tail); the smallest trace share is 90% (mean tail). 2 of 5 truncations have a ratio on both "
        "optimizers (the others: — not run, n/a outside their strengths)."
    )
    assert "the smallest trace share is none." in rank_tail_rule(_rows(dpo_share_kl=0.13), PLAN)  # 1.3 on DPO
    sft_only = [r for r in _rows() if r.get("arm", {}).get("optimizer") != "dpo"]
    assert "the smallest absolute rank is none; the smallest trace share is none. 0 of 5" in rank_tail_rule(
        sft_only, PLAN
    )
    # rank 64 with the zero tail too: 1 on SFT (the same KL at both strengths), 1.1 on DPO
    both = [r for r in _rows() if r.get("arm", {}).get("anchor") != "math_r64"]
    both += [_row("sft", 1.0, "math_r64", 3.5, 2.0), _row("sft", 10.0, "math_r64", 2.5, 2.0)]
    both += [_row("dpo", 1.0, "math_r64", 21.0, 0.11), _row("dpo", 10.0, "math_r64", 19.0, 0.11)]
    assert "the smallest absolute rank is 64 (mean and zero tails)" in rank_tail_rule(both, PLAN)


def test_the_report_has_the_section_per_optimizer_then_the_rule():
    report = markdown_report(_rows(), PLAN)
    sft = report.index("### Rank and tail sweep: SFT (CFP-KFAC [math], seed 0)")
    dpo = report.index("### Rank and tail sweep: DPO (CFP-KFAC [math], seed 0)")
    assert sft < dpo < report.index("Within 1.25x of full rank's math KL")
    assert "### Rank and tail sweep" not in markdown_report(_rows(), replace(PLAN, kfac_tail_ranks=(), kfac_shares=()))
    assert math.isclose(kl_at_gain([(3.5, 6.0), (2.5, 1.5)], 3.0), 3.0)


def test_a_sweep_that_stays_below_full_ranks_gain_gives_a_lower_bound():
    """math_s90 under SFT gets no further than progress 2.9 < 3 (full rank's): its KL at 3 is at least that of its
    furthest point, 5 (ratio >= 2.5), shown as a bound and counted against the rule."""
    rows = [
        r for r in _rows() if not (r.get("arm", {}).get("anchor") == "math_s90" and r["arm"]["optimizer"] == "sft")
    ]
    rows += [_row("sft", 1.0, "math_s90", 2.9, 5.0), _row("sft", 10.0, "math_s90", 2.5, 2.0)]
    assert lower_bounds(rows, PLAN, "sft") == {"math_s90": (5.0, 2.5)}
    assert lower_bounds(_rows(), PLAN, "sft") == {}  # every other sweep reaches or passes 3
    assert rank_tail_table(rows, PLAN, "sft").splitlines()[-1].endswith("| >= 5 | >= 2.50 |")
    assert rank_tail_rule(rows, PLAN).endswith("; 1 more are above 1.25x on some optimizer by a lower bound (>=).")
