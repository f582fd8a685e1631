"""The evidence plan (which arms run, which are table rows) and the report's arithmetic, on hand-made result rows:
relative DtFD against the same seed's unregularized run, means and sample standard deviations over seeds, and
frontier curves ordered by strength from the unregularized point. Expected values are written out by hand."""

import math

import pytest
import torch
from support.extras import needs

needs("trl", "datasets")

from evidence.anchors import pooled  # noqa: E402
from evidence.plan import DOMAINS, EMBEDDED, TINY, Arm, is_new  # noqa: E402
from evidence.report import capability_table, drift_table, frontier_points, row_label  # noqa: E402

from hf_cfp import FisherAnchor  # noqa: E402


def test_every_arm_is_unique_and_later_seeds_repeat_only_the_table_rows():
    for plan in (TINY, EMBEDDED):
        assert len({arm.key for arm in plan.arms()}) == len(plan.arms())
        arms = plan.diagonal_arms()  # the arms of the first experiment (K-FAC and RL arms: the tests below)
        first, *others = plan.seeds
        for optimizer in plan.optimizers:
            table = [a for a in arms if a.seed == first and a.optimizer == optimizer and plan.is_table_row(a)]
            # unregularized, first KL, CFP x 3 anchors, step-only, isotropic
            assert [row_label(a.__dict__) for a in table] == [
                "unregularized",
                f"KL control (beta {plan.kl_betas(optimizer)[0]:g})",
                "CFP [math]",
                "CFP [code]",
                "CFP [safety]",
                "step-only [math]",
                "isotropic [math]",
            ]
            for seed in others:
                repeated = [a for a in arms if a.seed == seed and a.optimizer == optimizer]
                assert [(a.method, a.strength, a.anchor) for a in repeated] == [
                    (a.method, a.strength, a.anchor) for a in table
                ]
        sweeps_per_optimizer = (
            1 + len(plan.sft_kl_betas) + 2 * len(plan.cfp_strengths) + 2 + len(plan.isotropic_strengths)
        )
        quality = len(plan.quality_anchors()) * len(plan.cfp_strengths)
        assert len(arms) == 2 * sweeps_per_optimizer + quality + (len(plan.seeds) - 1) * 2 * 7


def test_greedy_scores_are_measured_on_four_rows_of_the_first_seed():
    greedy = [a for a in EMBEDDED.diagonal_arms() if EMBEDDED.measures_greedy(a)]
    assert {(a.optimizer, a.method, a.anchor) for a in greedy} == {
        (o, m, anchor) for o in ("sft", "dpo") for m, anchor in [("unregularized", None), ("kl", None)]
    } | {(o, "cfp", d) for o in ("sft", "dpo") for d in ("math", "safety")}
    assert {a.seed for a in greedy} == {EMBEDDED.seeds[0]}
    # of the new arms: CFP-KFAC [math] and [safety] at c = 1 on the first seed, SFT and DPO (no RL arm)
    new = [a.key for a in EMBEDDED.arms() if is_new(a) and EMBEDDED.measures_greedy(a)]
    assert new == [f"{o}/kfac[{d}]@1/seed0" for o in ("sft", "dpo") for d in ("math", "safety")]


def _row(optimizer, method, strength, seed, anchor, dtfd, kl=0.0, task=0.0):
    arm = Arm(optimizer, method, strength, seed, anchor)
    metrics = {f"{d}/dtfd": value for d, value in zip(DOMAINS, dtfd, strict=True)}
    metrics |= {"math/kl": kl, "task/sft_gain": task, "task/dpo_margin": task}
    return {"key": arm.key, "arm": arm.__dict__, "metrics": metrics}


def test_drift_table_is_relative_to_the_same_seeds_unregularized_run():
    rows = [
        _row("sft", "unregularized", 0.0, 0, None, (2.0, 4.0, 8.0)),
        _row("sft", "unregularized", 0.0, 1, None, (4.0, 4.0, 4.0)),
        _row("sft", "cfp", 1.0, 0, "math", (1.0, 3.0, 8.0)),  # -50%, -25%, 0%
        _row("sft", "cfp", 1.0, 1, "math", (1.0, 4.0, 2.0)),  # -75%, 0%, -50%
        _row("dpo", "unregularized", 0.0, 0, None, (1.0, 1.0, 1.0)),  # another optimizer: ignored
    ]
    table = drift_table(rows, "sft", lambda arm: True).splitlines()
    sd = lambda a, b: abs(a - b) / math.sqrt(2)  # noqa: E731  sample standard deviation of two values
    assert table[2] == f"| unregularized | 3 ± {sd(2, 4):.2g} (abs.) | 4 ± 0 (abs.) | 6 ± {sd(8, 4):.2g} (abs.) |"
    assert table[3] == (
        f"| CFP [math] | -62% ± {sd(-0.5, -0.75):.0%} | -12% ± {sd(-0.25, 0):.0%} | -25% ± {sd(0, -0.5):.0%} |"
    )
    assert len(table) == 4


def test_capability_table_averages_over_seeds_and_leaves_missing_scores_blank():
    base = {"key": "base", "metrics": {"math/kl": 0.0, "task/sft_gain": 0.0, "math/exact_match": 0.25}}
    rows = [base, _row("sft", "unregularized", 0.0, 0, None, (1, 1, 1), kl=2.0, task=1.0)]
    rows.append(_row("sft", "unregularized", 0.0, 1, None, (1, 1, 1), kl=4.0, task=3.0))
    rows[1]["metrics"]["math/exact_match"] = 0.5  # greedy scores on the first seed only
    lines = capability_table(rows, "sft", lambda arm: True).splitlines()
    cells = [c.strip() for c in lines[3].split("|")[1:-1]]
    assert cells[:3] == ["unregularized", "2", "3"]  # task mean (1+3)/2, math KL mean (2+4)/2
    assert cells[6] == "50%"  # exact match of the one seed that has it
    assert cells[4] == ""  # no safety KL in these rows
    assert [c.strip() for c in lines[2].split("|")[1:-1]][6] == "25%"


def test_frontier_curves_start_at_the_unregularized_point_and_follow_strength():
    rows = [
        _row("sft", "unregularized", 0.0, 0, None, (1, 1, 1), kl=5.0, task=2.0),
        _row("sft", "cfp", 10.0, 0, "math", (1, 1, 1), kl=1.0, task=1.0),
        _row("sft", "cfp", 1.0, 0, "math", (1, 1, 1), kl=3.0, task=1.5),
        _row("sft", "cfp", 1.0, 1, "math", (1, 1, 1), kl=9.0, task=9.0),  # another seed: left out
        _row("sft", "cfp", 1.0, 0, "code", (1, 1, 1), kl=7.0, task=7.0),  # not a math-type anchor: left out
        _row("sft", "kl", 0.3, 0, None, (1, 1, 1), kl=4.0, task=1.8),
    ]
    curves = frontier_points(rows, "sft", (None, "math"), {0})
    assert curves == {"CFP [math]": [(5.0, 2.0), (3.0, 1.5), (1.0, 1.0)], "KL control": [(5.0, 2.0), (4.0, 1.8)]}


def test_pooled_anchor_is_the_mean_of_its_parts():
    g = torch.Generator().manual_seed(0)
    parts = [
        FisherAnchor({"w": torch.rand(3, 4, generator=g), "b": torch.rand(4, generator=g)}, name=f"p{k}")
        for k in range(3)
    ]
    anchor = pooled(parts, "pooled")
    for key in ("w", "b"):
        flat = [
            sum(float(p.fisher[key].reshape(-1)[i]) for p in parts) / 3 for i in range(parts[0].fisher[key].numel())
        ]
        assert anchor.fisher[key].reshape(-1).tolist() == pytest.approx(flat, rel=1e-6)
    assert anchor.name == "pooled" and [p["name"] for p in anchor.metadata["combined_from"]] == ["p0", "p1", "p2"]
    assert anchor.metadata["statistics"]["num_parameters"] == 16  # recomputed for the pooled values
