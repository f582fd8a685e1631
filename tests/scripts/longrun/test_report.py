"""The long run's report on hand-made rows: task progress along a run (GRPO: the logged reward less the base
model's), the linear interpolation of a frontier, and the matched-progress table against values worked out by
hand."""

import pytest
from support.extras import needs

needs("trl", "datasets")

from longrun.plan import EMBEDDED  # noqa: E402
from longrun.report import (  # noqa: E402
    BEYOND,
    BEYOND_NOTE,
    compared_seeds,
    kl_at,
    least_kl_line,
    lower_envelope,
    markdown_report,
    matched_table,
    method_colours,
    plot_report,
    seeds_table,
    strength_rank,
    task_curve,
    trajectory_table,
)


def row(optimizer, method, strength, gain, kl, anchor=None):
    """A row whose code KL is twice and safety KL three times its math KL."""
    task = {"sft": "task/sft_gain", "grpo-pirate": "task/pirate_gain", "grpo-brevity": "task/brevity_gain"}[optimizer]
    arm = {"optimizer": optimizer, "method": method, "strength": strength, "seed": 0, "anchor": anchor}
    metrics = {task: gain, "math/kl": kl, "code/kl": 2 * kl, "safety/kl": 3 * kl}
    return {"key": f"{optimizer}/{method}@{strength}", "arm": arm, "metrics": metrics}


def cells(values, beyond=()):
    """A table row's cells as `matched_table` writes them: three significant digits, "n/a" for None, and `BEYOND`
    after the cells at the indices in `beyond`."""
    return " | ".join(
        "n/a" if v is None else f"{v:.3g}" + (BEYOND if i in beyond else "") for i, v in enumerate(values)
    )


def test_task_curves_read_the_held_out_points_or_the_logged_reward():
    sft = {"curve": [{"step": 32, "task/sft_gain": 1.0}, {"step": 64, "task/sft_gain": 1.2}]}
    assert task_curve(sft, "sft", EMBEDDED) == [(32, 1.0), (64, 1.2)]
    history = [{"step": 8, "loss": 0.1, "reward": 0.02}, {"step": 16, "loss": 0.1}, {"step": 16, "reward": 0.05}]
    pirate = {"task/pirate_reward": 0.05, "task/pirate_gain": 0.05}
    assert task_curve({"curve": [], "history": history, "metrics": pirate}, "grpo-pirate", EMBEDDED) == [
        (8, 0.02),
        (16, 0.05),
    ]


def test_a_grpo_curve_counts_progress_from_the_base_models_reward():
    """The brevity reward is -length / 100: a base model at -1.0 (held-out reward -0.25 at gain 0.75) whose logged
    reward climbs to -0.6 and -0.25 has progressed 0.4 and 0.75, not -0.6 and -0.25."""
    history = [{"step": 8, "reward": -0.6}, {"step": 16, "reward": -0.25}]
    brevity = {"task/brevity_reward": -0.25, "task/brevity_gain": 0.75}
    curve = task_curve({"curve": [], "history": history, "metrics": brevity}, "grpo-brevity", EMBEDDED)
    assert curve == [(8, pytest.approx(0.4)), (16, pytest.approx(0.75))]


def test_kl_at_interpolates_linearly_between_bracketing_points_only():
    points = [(0.0, 0.0), (1.0, 2.0), (2.0, 6.0)]
    assert kl_at(points, 0.5) == pytest.approx(1.0)
    assert kl_at(points, 1.5) == pytest.approx(4.0)
    assert kl_at(points, 2.5) is None and kl_at([(1.0, 2.0)], 0.5) is None


def test_a_frontier_keeps_only_the_points_no_other_beats():
    """(2, 6) beats (2, 8); (1.5, 1) beats (1, 2) and (0.5, 3). LwF at (2.1, 1) beats the unregularized end (2, 8),
    so its frontier runs from the base straight to it: KL 1 * 0.4 / 2.1, 1 / 2.1 and 1.6 / 2.1 at the targets."""
    assert lower_envelope([(1.0, 2.0), (2.0, 6.0), (1.5, 1.0), (2.0, 8.0), (0.5, 3.0)]) == [(1.5, 1.0), (2.0, 6.0)]
    rows = [row("sft", "unregularized", 0.0, 2.0, 8.0), row("sft", "lwf", 1.0, 2.1, 1.0, "math")]
    math = [0.4 / 2.1, 1.0 / 2.1, 1.6 / 2.1]
    expected = [*math, *(2 * v for v in math), *(3 * v for v in math)]
    table = matched_table(rows, EMBEDDED, "sft", 0)
    assert "| LwF distillation | " + cells(expected) + " |" in table
    assert BEYOND not in table  # LwF's own point reaches every target


def test_the_matched_table_names_the_least_kl_at_each_share():
    """Unregularized gain 2 at KL 8: targets 0.4 (20%), 1.0 (50%) and 1.6 (80%). Every frontier starts at the base
    model (0, 0). The KL penalty (1, 2), (1.5, 5) then the unregularized end: 2 * 0.4 = 0.8, 2.0 and
    5 + 3 * 0.1 / 0.5 = 5.6 (80%: between (1.5, 5) and (2, 8)). CFP diagonal (0.5, 0.5), (1.8, 2.8): 0.4,
    0.5 + 2.3 * 0.5 / 1.3 and 0.5 + 2.3 * 1.1 / 1.3. LoRA alone at (1, 4) has no strength to sweep: n/a throughout.
    LoRA + CFP-KFAC at (0.5, 1.5) runs to LoRA alone, its zero strength: 3 * 0.4 = 1.2, 4 (at LoRA's point), n/a.
    Past its own arms' most progress (KL penalty 1.5, LoRA + CFP-KFAC 0.5) a value is marked: the KL penalty's at 80%,
    LoRA + CFP-KFAC's at 50%; the diagonal's 1.8 reaches every target."""
    rows = [
        row("sft", "unregularized", 0.0, 2.0, 8.0),
        row("sft", "kl", 3.0, 1.0, 2.0),
        row("sft", "kl", 0.3, 1.5, 5.0),
        row("sft", "cfp", 10.0, 0.5, 0.5, "math"),
        row("sft", "cfp", 1.0, 1.8, 2.8, "math"),
        row("sft", "lora", 0.0, 1.0, 4.0),
        row("sft", "lora_kfac", 1.0, 0.5, 1.5, "math_t256"),
    ]
    table = matched_table(rows, EMBEDDED, "sft", 0)
    cfp_50, cfp_80 = 0.5 + 2.3 * 0.5 / 1.3, 0.5 + 2.3 * 1.1 / 1.3
    kl_row = [0.8, 2.0, 5.6, 1.6, 4.0, 11.2, 2.4, 6.0, 16.8]  # math, code, safety at 20%, 50% and 80%
    cfp_row = [0.4, cfp_50, cfp_80, 0.8, 2 * cfp_50, 2 * cfp_80, 1.2, 3 * cfp_50, 3 * cfp_80]
    lora_kfac_row = [1.2, 4.0, None, 2.4, 8.0, None, 3.6, 12.0, None]
    assert "| KL penalty | " + cells(kl_row, beyond={2, 5, 8}) + " |" in table
    assert "| CFP diagonal | " + cells(cfp_row) + " |" in table
    assert "| LoRA | " + cells([None] * 9) + " |" in table
    assert "| LoRA + CFP-KFAC t256 | " + cells(lora_kfac_row, beyond={1, 4, 7}) + " |" in table
    assert f"- math at 80%: least KL CFP diagonal ({cfp_80:.3g}); next KL penalty{BEYOND} (5.6, " in table
    assert "- math at 20%: least KL CFP diagonal (0.4); next KL penalty (0.8, 2.0x)" in table
    assert f"- math at 50%: least KL CFP diagonal ({cfp_50:.3g}); next KL penalty (2, {2 / cfp_50:.1f}x)" in table
    assert f"- safety at 80%: least KL CFP diagonal ({3 * cfp_80:.3g}); next KL penalty{BEYOND} (16.8, " in table
    assert f"{BEYOND} {BEYOND_NOTE}" in table


def test_early_stopping_is_the_unregularized_runs_own_curve_from_the_base():
    """Unregularized gain 2 at KL 8, measured at (0.8, 2) and (2, 8) along the way: with the base at (0, 0), the
    early-stopping KL at 20% (0.4) is 2 * 0.4 / 0.8 = 1, at 50% (1.0) 2 + 6 * 0.2 / 1.2 = 3 and at 80% (1.6)
    2 + 6 * 0.8 / 1.2 = 6."""
    unregularized = row("sft", "unregularized", 0.0, 2.0, 8.0)
    curve = [(0.8, 2.0), (2.0, 8.0)]
    unregularized["curve"] = [
        {"step": s, "task/sft_gain": g, "math/kl": k, "code/kl": 2 * k, "safety/kl": 3 * k}
        for s, (g, k) in enumerate(curve, 1)
    ]
    table = matched_table([unregularized, row("sft", "kl", 0.3, 1.5, 5.0)], EMBEDDED, "sft", 0)
    assert "| early stopping | 1 | 3 | 6 | 2 | 6 | 12 | 3 | 9 | 18 |" in table
    grpo = row("grpo-pirate", "unregularized", 0.0, 0.1, 1.0)
    grpo["curve"] = [{"step": 1, "math/kl": 0.5, "code/kl": 1.0, "safety/kl": 1.5}]
    assert "early stopping" not in matched_table([grpo], EMBEDDED, "grpo-pirate", 0)


def test_along_each_run_reads_the_arms_own_curve_from_the_base_at_step_zero():
    """Unregularized final gain 2: targets 0.4, 1.0 and 1.6. The KL penalty measured at (0.5, 1) and (1.5, 2): 20%
    at 1 * 0.4 / 0.5 = 0.8 (from the base at (0, 0)), 50% at 1 + 1 * 0.5 / 1 = 1.5; it never reaches 1.6 (n/a). CFP
    diagonal measured at (2, 0.4) only: from (0, 0), 0.08, 0.2 and 0.32. Code and safety KL are twice and three
    times math's."""

    def curve(points):
        return [
            {"step": s, "task/sft_gain": g, "math/kl": k, "code/kl": 2 * k, "safety/kl": 3 * k}
            for s, (g, k) in enumerate(points, 1)
        ]

    unregularized = row("sft", "unregularized", 0.0, 2.0, 8.0)
    unregularized["curve"] = curve([(2.0, 8.0)])
    kl, cfp = row("sft", "kl", 0.3, 1.5, 2.5), row("sft", "cfp", 1.0, 2.0, 0.5, "math")
    kl["curve"], cfp["curve"] = curve([(1.5, 2.0), (0.5, 1.0)]), curve([(2.0, 0.4)])
    table = trajectory_table([unregularized, kl, cfp], EMBEDDED, "sft", 0)
    assert "| KL penalty | 0.3 | 0.8 | 1.5 | n/a | 1.6 | 3 | n/a | 2.4 | 4.5 | n/a |" in table
    assert "| CFP diagonal | 1 | 0.08 | 0.2 | 0.32 | 0.16 | 0.4 | 0.64 | 0.24 | 0.6 | 0.96 |" in table
    assert "unregularized" not in table
    assert trajectory_table([unregularized, kl], EMBEDDED, "grpo-pirate", 0) == ""


def test_along_each_grpo_run_the_progress_is_the_logged_reward_gain_at_each_measured_step():
    """Brevity, base model's reward -1. The unregularized run's last logged reward is 0.0, a gain of 1.0: targets
    0.2, 0.5, 0.8. The KL penalty logs reward -0.9 at step 8 and -0.5 at step 16 (gains 0.1 and 0.5), where its
    math KL is 1 and 3 (its step-12 point has no logged reward and is not used): 20% at 1 + 2 * (0.2 - 0.1) / 0.4 =
    1.5, 50% at 3, never 80%."""

    def grpo(method, strength, gains, kls):
        arm = row("grpo-brevity", method, strength, gains[-1], kls[-1])
        arm["metrics"]["task/brevity_reward"] = gains[-1] - 1.0
        history = [{"step": s, "loss": 0.0, "reward": g - 1.0} for s, g in zip((8, 16), gains, strict=True)]
        arm["history"] = history
        arm["curve"] = [
            {"step": s, "math/kl": k, "code/kl": 2 * k, "safety/kl": 3 * k}
            for s, k in zip((8, 12, 16), (kls[0], 100.0, kls[1]), strict=True)
        ]
        return arm

    table = trajectory_table(
        [grpo("unregularized", 0.0, (0.2, 1.0), (5.0, 9.0)), grpo("kl", 0.05, (0.1, 0.5), (1.0, 3.0))],
        EMBEDDED,
        "grpo-brevity",
        0,
    )
    assert "math KL at 20% (0.2) | math KL at 50% (0.5) | math KL at 80% (0.8)" in table
    assert "| KL penalty | 0.05 | 1.5 | 3 | n/a | 3 | 6 | n/a | 4.5 | 9 | n/a |" in table


def test_the_plots_draw_a_methods_strengths_in_one_colour_and_its_second_strength_dashed():
    """EMBEDDED's SFT sweeps: KL penalty beta (0.3, 3), diagonal CFP c (1, 10); DPO CFP c (1, 0.1)."""
    arm = row("sft", "kl", 3.0, 1.0, 1.0)["arm"]
    assert strength_rank(arm, EMBEDDED) == 1
    assert strength_rank({**arm, "strength": 0.3}, EMBEDDED) == 0
    assert strength_rank({**arm, "method": "unregularized", "strength": 0.0}, EMBEDDED) == 0
    dpo_cfp = {"optimizer": "dpo", "method": "cfp", "strength": 0.1, "seed": 0, "anchor": "math"}
    assert strength_rank(dpo_cfp, EMBEDDED) == 1
    assert method_colours(["KL penalty", "LoRA", "KL penalty", "WiSE-FT"]) == {
        "KL penalty": "C0",
        "LoRA": "C1",
        "WiSE-FT": "C2",
    }
    assert len(set(method_colours([str(i) for i in range(12)]).values())) == 12


def test_the_least_kl_line_compares_the_winner_with_the_runner_up_and_the_best_of_the_other_kind():
    cfp_wins = [(0.02, "CFP-KFAC t256"), (0.03, "CFP-KFAC full rank"), (0.6, "LwF distillation"), (1.7, "WiSE-FT")]
    assert least_kl_line(cfp_wins) == (
        "least KL CFP-KFAC t256 (0.02); next CFP-KFAC full rank (0.03, 1.5x);"
        " best baseline LwF distillation (0.6, 30x)"
    )
    baseline_wins = [(0.14, "LwF distillation"), (5.6, "WiSE-FT"), (9.8, "CFP-KFAC full rank"), (12.6, "CFP diagonal")]
    assert least_kl_line(baseline_wins) == (
        "least KL LwF distillation (0.14); next WiSE-FT (5.6, 40x); best CFP method CFP-KFAC full rank (9.8, 70x)"
    )
    runner_up_of_the_other_kind = [(0.4, "CFP diagonal"), (0.8, "KL penalty"), (1.2, "LoRA + CFP-KFAC t256")]
    assert least_kl_line(runner_up_of_the_other_kind) == "least KL CFP diagonal (0.4); next KL penalty (0.8, 2.0x)"
    assert least_kl_line([(0.01, "CFP diagonal"), (3.71, "KL penalty")]).endswith("(3.71, 371x)")
    assert least_kl_line([(5.68, "CFP-KFAC t256"), (5.77, "KL penalty")]).endswith("(5.77, 1.0x)")
    at_zero = [(-0.0006, "CFP-KFAC t256"), (0.0009, "CFP-KFAC full rank"), (0.0079, "LwF distillation")]
    assert least_kl_line(at_zero) == (
        "least KL CFP-KFAC t256 (-0.0006); next CFP-KFAC full rank (0.0009); best baseline LwF distillation (0.0079)"
        " (the least is at or below zero: no ratio)"
    )


def test_the_report_gives_each_rows_seed_and_compares_a_seed_once_it_has_an_arm_beside_its_unregularized_run():
    """Seed 0 has the unregularized run and the KL penalty; seed 1 only its unregularized run so far."""
    rows = [row("grpo-pirate", "unregularized", 0.0, 1.0, 9.0), row("grpo-pirate", "kl", 0.05, 0.5, 2.0)]
    later = row("grpo-pirate", "unregularized", 0.0, 0.8, 7.0)
    later["arm"]["seed"] = 1
    report = markdown_report([*rows, later], EMBEDDED)
    assert "| KL penalty | 0.05 | 0 | " in report
    assert "| unregularized | 0 | 1 | " in report
    assert "### At matched task progress (seed 0)" in report
    assert "(seed 1)" not in report


def seeded(seed, *rows_):
    """`rows_` moved to `seed`."""
    return [{**r, "arm": {**r["arm"], "seed": seed}} for r in rows_]


def test_the_plots_draw_each_compared_seed_frontiers_in_one_column_curves_in_one_column_each(tmp_path):
    """GRPO-pirate seeds 0 and 1 each have an arm beside the unregularized run, seed 2 only its unregularized run;
    SFT has seed 0. At 5 inches per column and 120 dpi: the frontiers 2 columns (SFT; GRPO-pirate's two seeds in
    one), the curves 3 (SFT; GRPO-pirate seed 0; seed 1)."""
    needs("matplotlib")
    from PIL import Image

    pirate = [row("grpo-pirate", "unregularized", 0.0, 1.0, 9.0), row("grpo-pirate", "kl", 0.05, 0.5, 2.0)]
    rows = [*pirate, *seeded(1, *pirate), *seeded(2, pirate[0]), row("sft", "unregularized", 0.0, 1.0, 5.0)]
    rows += [row("sft", "cfp", 1.0, 0.6, 0.5, "math")]
    for r in rows:
        r["curve"] = [{"step": 8, "math/kl": 1.0, "code/kl": 2.0, "safety/kl": 3.0, "task/sft_gain": 0.5}]
        r["metrics"]["task/pirate_reward"] = r["metrics"].get("task/pirate_gain", 0.0)
        r["history"] = [{"step": 8, "reward": 0.5}]
    assert compared_seeds(rows, "grpo-pirate") == [0, 1] and compared_seeds(rows, "sft") == [0]
    frontier, curves = plot_report(rows, EMBEDDED, tmp_path)
    assert Image.open(frontier).width == 2 * 5 * 120
    assert Image.open(curves).width == 3 * 5 * 120


def test_seed_by_seed_sets_each_arm_run_on_two_seeds_side_by_side_with_its_intervals():
    """The KL penalty ran on seeds 0 and 1 (gain 0.5 +- 1.96 * 0.1 and 0.3, no stderr), LwF on seed 0 alone: one
    row, the seeds' values in seed order; a plan with no arm on two seeds has no table."""
    kl = row("sft", "kl", 0.3, 0.5, 2.0)
    kl["metrics"] |= {"task/sft_gain_stderr": 0.1, "math/exact_match": 0.25, "safety/refusal_rate": 2 / 24}
    later = seeded(1, row("sft", "kl", 0.3, 0.3, 4.0))[0]
    later["metrics"] |= {"math/exact_match": 0.2, "safety/refusal_rate": 0.0}
    lwf = row("sft", "lwf", 1.0, 0.4, 1.0, "math")
    table = seeds_table([kl, lwf, later], EMBEDDED, "sft")
    lines = table.splitlines()
    assert lines[0].startswith("| arm | strength | seeds | task/sft_gain | math KL |") and len(lines) == 3
    assert lines[2] == "| KL penalty | 0.3 | 0/1 | 0.5 ± 0.196 / 0.3 | 2 / 4 | 6 / 12 | 0.25 / 0.20 | 0.08 / 0.00 |"
    assert seeds_table([kl, lwf], EMBEDDED, "sft") == ""
