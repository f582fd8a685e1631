"""The arms added with the K-FAC anchors (issue 25) in the evidence plan: their keys, written out; the anchors each
needs and how each is made; and that every arm of the committed first run keeps its key and its definition, so
that a run resumed from the committed `results.jsonl` computes only the new arms."""

import json
from pathlib import Path

from support.extras import needs

needs("trl", "datasets")

from evidence.plan import (  # noqa: E402
    DOMAINS,
    EMBEDDED,
    TINY,
    AnchorSpec,
    Arm,
    is_new,
    kfac_anchor_name,
    kfac_lam_anchor,
    rl_reward,
)

COMMITTED = Path(__file__).resolve().parents[3] / "scripts" / "results" / "evidence-smollm2" / "results.jsonl"


def test_every_committed_arm_is_still_planned_with_the_same_fields():
    rows = [json.loads(line) for line in COMMITTED.read_text().splitlines() if line.strip()]
    committed = [row for row in rows if row["key"] != "base"]
    planned = {arm.key: arm for arm in EMBEDDED.arms()}
    assert len(committed) >= 80  # the plan of issue 25 ran whole; the rank and tail sweep (issue 30) comes after it
    assert all(planned[row["key"]] == Arm(**row["arm"]) for row in committed)
    arms = committed[:80]
    for row in arms:
        arm = Arm(**row["arm"])
        assert arm.key == row["key"] and planned[row["key"]] == arm
    # the committed rows are the plan's first 80 arms, in the order they ran: the sweep only appends
    assert [arm.key for arm in EMBEDDED.arms()[:80]] == [row["key"] for row in arms]
    first = [row for row in arms if not is_new(Arm(**row["arm"]))]
    assert len(first) == 44
    assert all(EMBEDDED.logging_steps(Arm(**row["arm"])) == EMBEDDED.steps // 3 for row in first)  # as it ran
    # the first experiment's arms are exactly its committed rows, in the order they ran, and come first
    assert [arm.key for arm in EMBEDDED.diagonal_arms()] == [row["key"] for row in first]
    assert [row["key"] for row in arms[:44]] == [row["key"] for row in first]
    assert EMBEDDED.arms()[:44] == EMBEDDED.diagonal_arms()


def test_the_new_arms_of_the_embedded_plan():
    sweeps = [("math", 1), ("code", 1), ("safety", 1), ("math", 10), ("math", 100)]
    sweeps += [("math_r8", 1), ("math_r64", 1), ("math_n16", 1), ("math_n64", 1), ("math_n128", 1)]
    first = [f"{o}/kfac[{anchor}]@{c}/seed0" for o in ("sft", "dpo") for anchor, c in sweeps]
    methods = ["unregularized@0", "kl@0.05", "isotropic[math]@1", "cfp[math]@1", "kfac[math]@1"]
    rl = [f"rloo-{reward}/{m}/seed0" for reward in ("pirate", "brevity") for m in methods]
    second = [f"{o}/kfac[{d}]@1/seed1" for o in ("sft", "dpo") for d in DOMAINS]
    new = [arm for arm in EMBEDDED.arms()[:80] if is_new(arm)]  # those of issue 25 (the sweep's: their own tests)
    assert [arm.key for arm in new] == first + rl + second
    assert all(EMBEDDED.logging_steps(arm) == EMBEDDED.steps for arm in new)  # metrics at the last step only
    # table rows: CFP-KFAC with a domain anchor at c = 1 (every seed), and every RL arm
    table = {arm.key for arm in new if EMBEDDED.is_table_row(arm)}
    assert table == {f"{o}/kfac[{d}]@1/seed{s}" for o in ("sft", "dpo") for d in DOMAINS for s in (0, 1)} | set(rl)
    assert [rl_reward(o) for o in EMBEDDED.rl_optimizers()] == ["pirate", "brevity"]
    assert EMBEDDED.kl_betas("rloo-brevity") == (0.05,)


def test_the_tiny_plan_runs_every_method_of_every_optimizer():
    arms = TINY.arms()
    for optimizer in ("sft", "dpo", "rloo-pirate", "rloo-brevity"):
        methods = {arm.method for arm in arms if arm.optimizer == optimizer}
        assert {"unregularized", "kl", "cfp", "kfac", "isotropic"} <= methods
    kfac = {arm.anchor for arm in arms if arm.method == "kfac"}
    sweep = {"math_t2", "math_s80", "code_t2", "safety_t2"}  # rank 2 with both tails, a share, the default's rows
    assert kfac == {*DOMAINS, "math_r2", "math_r8", "math_n4", "math_n16", "math_n32"} | sweep


def test_each_arm_names_the_anchors_it_needs():
    domains = set(DOMAINS)
    assert EMBEDDED.anchors_of(Arm("sft", "unregularized", 0.0, 0)) == domains
    assert EMBEDDED.anchors_of(Arm("sft", "cfp", 1.0, 1, "math_n64")) == domains | {"math_n64"}
    assert EMBEDDED.anchors_of(Arm("dpo", "isotropic", 1.0, 0, "math")) == domains | {"isotropic"}
    assert EMBEDDED.anchors_of(Arm("sft", "kfac", 1.0, 0, "code")) == domains | {"math_kfac", "code_kfac"}
    assert EMBEDDED.anchors_of(Arm("dpo", "kfac", 1.0, 0, "math_r8")) == domains | {"math_kfac", "math_kfac_r8"}
    assert EMBEDDED.anchors_of(Arm("sft", "kfac", 1.0, 0, "math_n16")) == domains | {"math_kfac", "math_kfac_n16"}
    assert EMBEDDED.anchors_of(Arm("rloo-pirate", "kl", 0.05, 0)) == domains | {"math_kfac"}
    # lam = c / p99: a truncation takes the full anchor's p99, another size its own
    assert [kfac_anchor_name(x) for x in ("math", "math_r8", "math_n16")] == [
        "math_kfac",
        "math_kfac_r8",
        "math_kfac_n16",
    ]
    assert [kfac_lam_anchor(x) for x in ("code", "math_r8", "math_n16")] == ["code_kfac", "math_kfac", "math_kfac_n16"]


def test_each_anchor_says_how_it_is_made():
    specs = EMBEDDED.anchor_specs()
    kfac = "math_kfac", "math_kfac_part1", "math_kfac_part2", "math_kfac_part3"
    assert specs["math_kfac"] == AnchorSpec("estimated", "math", 32, structure="kfac")
    assert specs["safety_kfac"] == AnchorSpec("estimated", "safety", 32, structure="kfac")
    assert specs["math_kfac_part3"] == AnchorSpec("estimated", "math", 32, seed=3, structure="kfac")
    assert specs["math_kfac_n16"] == AnchorSpec("estimated", "math", 16, structure="kfac")
    assert specs["math_kfac_n64"] == AnchorSpec("pooled", structure="kfac", parts=kfac[:2])
    assert specs["math_kfac_n128"] == AnchorSpec("pooled", structure="kfac", parts=kfac)
    assert specs["math_kfac_r64"] == AnchorSpec("truncated", source="math_kfac", rank=64)
    # the first experiment's diagonal anchors, made as they were
    assert specs["math"] == AnchorSpec("estimated", "math", 32)
    assert specs["math_n128"] == AnchorSpec("pooled", parts=("math", "math_part1", "math_part2", "math_part3"))
    assert specs["math_n16"] == AnchorSpec("estimated", "math", 16)
    assert specs["math_token"] == AnchorSpec("estimated", "math", 4, "token")
    assert specs["isotropic"] == AnchorSpec("isotropic", source="math")
    every = {name for arm in EMBEDDED.arms() for name in EMBEDDED.anchors_of(arm)}
    assert every <= set(specs)
