"""The rank and tail sweep of the evidence plan (issue 30): its labels and arms, written out, appended after every
committed arm and in the order an interrupted run should keep them; the default truncation's table rows; the
truncated anchors against the eigenvalues of the full factors computed here (float64 `eigh`: the mean tail is the
mean of the eigenvalues left out, the share rule's ranks come from a plain loop); and the anchors the store derives
for the tiny plan."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from support.extras import needs

needs("trl", "datasets")

from evidence.anchors import AnchorStore  # noqa: E402
from evidence.controls import floats_per_param, share_truncated_anchor, truncated_anchor  # noqa: E402
from evidence.plan import (  # noqa: E402
    DOMAINS,
    EMBEDDED,
    TINY,
    AnchorSpec,
    Arm,
    is_new,
    kfac_anchor_name,
    kfac_lam_anchor,
    truncation,
)
from evidence.run import tiny_model_and_tokenizer  # noqa: E402
from evidence.training import arm_callbacks  # noqa: E402

from hf_cfp import FisherAnchor  # noqa: E402

COMMITTED = Path(__file__).resolve().parents[3] / "scripts" / "results" / "evidence-smollm2" / "results.jsonl"


def test_truncated_labels_name_their_anchor_and_take_lam_from_the_full_one():
    assert truncation("math_t64") == ("math", "t", 64)
    assert truncation("math_r8") == ("math", "r", 8)
    assert truncation("code_s90") == ("code", "s", 90)
    assert [truncation(x) for x in ("math", "math_n16", "math_token", "math_t", "math_tx8")] == [None] * 5
    assert [kfac_anchor_name(x) for x in ("math_t64", "math_s90", "code_t64")] == [
        "math_kfac_t64",
        "math_kfac_s90",
        "code_kfac_t64",
    ]
    assert [kfac_lam_anchor(x) for x in ("math_t64", "math_s90", "code_t64", "safety_r8", "math_n16")] == [
        "math_kfac",
        "math_kfac",
        "code_kfac",
        "safety_kfac",
        "math_kfac_n16",
    ]


def _block(labels: list[str], strengths: tuple[int, ...]) -> list[str]:
    return [f"{o}/kfac[{label}]@{c}/seed0" for c in strengths for label in labels for o in ("sft", "dpo")]


def test_the_sweep_comes_after_every_committed_arm_in_the_order_an_interrupted_run_keeps():
    committed = [json.loads(line)["key"] for line in COMMITTED.read_text().splitlines() if line.strip()]
    committed.remove("base")
    keys = [arm.key for arm in EMBEDDED.arms()]
    assert keys[: len(committed)] == committed and len(set(keys)) == len(keys)  # the results are a prefix of the plan
    alone = replace(EMBEDDED, kfac_default=None)  # the sweep without the default's table rows
    keys = [arm.key for arm in alone.arms()]
    ranks, shares = (8, 16, 32, 64, 128, 256), (50, 80, 90, 95)
    mean, zero = [f"math_t{r}" for r in ranks], [f"math_r{r}" for r in ranks]
    share = [f"math_s{p}" for p in shares]
    ran = {"sft/kfac[math_r8]@1/seed0", "dpo/kfac[math_r8]@1/seed0", "sft/kfac[math_r64]@1/seed0"}
    ran.add("dpo/kfac[math_r64]@1/seed0")
    assert ran <= set(committed)
    expected = _block(mean, (1,)) + _block(mean, (0.3,)) + _block(share, (1, 0.3))
    expected += [k for k in _block(zero, (1,)) if k not in ran]
    assert keys[80:] == expected and len(expected) == 48  # ((6 x 2 + 4) at c = 1 + (6 + 4) at 0.3) x 2, less 4
    # spelled out at the block boundaries
    assert keys[80:83] == ["sft/kfac[math_t8]@1/seed0", "dpo/kfac[math_t8]@1/seed0", "sft/kfac[math_t16]@1/seed0"]
    assert keys[92:94] == ["sft/kfac[math_t8]@0.3/seed0", "dpo/kfac[math_t8]@0.3/seed0"]
    assert keys[104:106] == ["sft/kfac[math_s50]@1/seed0", "dpo/kfac[math_s50]@1/seed0"]
    assert keys[112] == "sft/kfac[math_s50]@0.3/seed0" and keys[120] == "sft/kfac[math_r16]@1/seed0"
    assert keys[-1] == "dpo/kfac[math_r256]@1/seed0"  # the other strengths: full rank and the default only
    sweep = alone.arms()[80:]
    assert all(is_new(arm) and alone.logging_steps(arm) == alone.steps for arm in sweep)
    assert not any(alone.is_table_row(arm) or alone.measures_greedy(arm) for arm in sweep)


def test_each_truncation_says_how_it_is_made_and_every_arm_finds_its_anchors():
    specs = EMBEDDED.anchor_specs()
    assert specs["math_kfac_r8"] == AnchorSpec("truncated", source="math_kfac", rank=8)  # as issue 25 made it
    assert specs["math_kfac_r8"].tail == "zero"
    assert specs["math_kfac_r16"] == AnchorSpec("truncated", "math", source="math_kfac", rank=16, tail="zero")
    assert specs["math_kfac_t256"] == AnchorSpec("truncated", "math", source="math_kfac", rank=256, tail="mean")
    assert specs["math_kfac_s90"] == AnchorSpec("truncated", "math", source="math_kfac", share=0.9, tail="mean")
    truncated = {name for name, spec in specs.items() if spec.kind == "truncated"}
    assert len(truncated) == 6 * 2 + 4 + 2  # and the default's code_kfac_t256, safety_kfac_t256
    assert EMBEDDED.anchors_of(Arm("sft", "kfac", 10.0, 0, "math_t64")) == {*DOMAINS, "math_kfac", "math_kfac_t64"}
    assert {name for arm in EMBEDDED.arms() for name in EMBEDDED.anchors_of(arm)} <= set(specs)


def test_the_default_truncation_adds_its_table_rows_and_strength_sweep_before_the_other_strengths():
    assert EMBEDDED.kfac_default == "math_t256"  # chosen by the sweep (docs/reports/evidence.md)
    plan = replace(EMBEDDED, kfac_default="math_t64")
    keys, before = [a.key for a in plan.arms()], [a.key for a in replace(EMBEDDED, kfac_default=None).arms()]
    deciding = 80 + 48  # the committed arms and the sweep's blocks at c = 1 and 0.3 (test above)
    assert len(before) == deciding and before[-1] == "dpo/kfac[math_r256]@1/seed0"
    sweep = [f"{o}/kfac[math_t64]@{c}/seed0" for c in (10, 100) for o in ("sft", "dpo")]
    assert keys[:deciding] == before and len(keys) == deciding + 14
    assert keys[deciding:] == [  # seed 0's math rows ran in the sweep
        "sft/kfac[code_t64]@1/seed0",
        "sft/kfac[safety_t64]@1/seed0",
        "dpo/kfac[code_t64]@1/seed0",
        "dpo/kfac[safety_t64]@1/seed0",
        *(f"{o}/kfac[{d}_t64]@1/seed1" for o in ("sft", "dpo") for d in DOMAINS),
        *sweep,
    ]
    rows = [a for a in plan.arms() if plan.is_table_row(a) and a.method == "kfac" and a.anchor not in DOMAINS]
    assert {(a.optimizer, a.anchor, a.seed) for a in rows} == {
        (o, f"{d}_t64", s) for o in ("sft", "dpo") for d in DOMAINS for s in (0, 1)
    }
    assert not any(plan.measures_greedy(a) for a in rows)  # greedy scores: the full-rank rows only, as before
    assert not plan.is_table_row(Arm("sft", "kfac", 10.0, 0, "math_t64"))  # another strength: a sweep point
    assert not plan.is_table_row(Arm("sft", "kfac", 1.0, 0, "math_t8"))  # another truncation: a sweep point
    specs = plan.anchor_specs()
    assert specs["code_kfac_t64"] == AnchorSpec("truncated", "code", source="code_kfac", rank=64, tail="mean")
    assert plan.anchors_of(Arm("dpo", "kfac", 1.0, 1, "safety_t64")) == {
        *DOMAINS,
        "math_kfac",
        "safety_kfac",
        "safety_kfac_t64",
    }
    share = replace(EMBEDDED, kfac_default="math_s90")
    assert share.anchor_specs()["code_kfac_s90"].share == 0.9
    with pytest.raises(ValueError, match="kfac_default"):
        replace(EMBEDDED, kfac_default="math")


def test_the_tiny_plan_exercises_every_new_kind():
    keys = {arm.key for arm in TINY.arms()}
    for label in ("math_t2", "math_r2", "math_s80"):
        assert {f"{o}/kfac[{label}]@1/seed0" for o in ("sft", "dpo")} <= keys
    assert {f"{o}/kfac[math_t2]@10/seed0" for o in ("sft", "dpo")} <= keys  # the default's strength sweep
    assert not any("math_r2]@10" in key or "math_s80]@10" in key for key in keys)
    for label in ("math_t2", "math_s80"):  # the weaker strength: mean tails only
        assert {f"{o}/kfac[{label}]@0.3/seed0" for o in ("sft", "dpo")} <= keys
    assert not any("math_r2]@0.3" in key for key in keys)
    assert {f"{o}/kfac[{d}_t2]@1/seed{s}" for o in ("sft", "dpo") for d in DOMAINS for s in TINY.seeds} <= keys
    assert len(TINY.arms()) == 94 + 8 + 18  # issue 25's, the sweep's (4 at c = 0.3), the default's


# --- the truncated anchors, against the full factors' eigenvalues computed here ---


def _psd(n: int, generator: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, n + 2, generator=generator, dtype=torch.float64)
    return x @ x.T / n


def _spectrum(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    values, vectors = torch.linalg.eigh(matrix)
    return values.flip(0), vectors.flip(1)


def _with_tail(matrix: torch.Tensor, rank: int, rho: float) -> torch.Tensor:
    """U diag(top values) U^T + rho (I - U U^T) of the top `rank` eigenpairs, float64."""
    values, vectors = _spectrum(matrix)
    kept = vectors[:, :rank]
    eye = torch.eye(len(values), dtype=torch.float64)
    return kept @ torch.diag(values[:rank]) @ kept.T + rho * (eye - kept @ kept.T)


@pytest.fixture(scope="module")
def full():
    g = torch.Generator().manual_seed(0)
    a, gg = _psd(6, g), _psd(5, g)
    return FisherAnchor({"b": torch.rand(5, generator=g)}, name="full", kfac={"w": (a.float(), gg.float())}), a, gg


def test_the_mean_tail_is_the_mean_of_the_eigenvalues_left_out(full):
    anchor, a, gg = full
    cut = truncated_anchor(anchor, 2, "cut", tail="mean")
    basis = cut.kfac["w"]
    rho_a, rho_g = float(_spectrum(a)[0][2:].mean()), float(_spectrum(gg)[0][2:].mean())
    assert float(basis.a_tail) == pytest.approx(rho_a, rel=1e-5)
    assert float(basis.g_tail) == pytest.approx(rho_g, rel=1e-5)
    got_a, got_g = cut.kfac_factors("w")
    assert torch.allclose(got_a.double(), _with_tail(a, 2, rho_a), atol=1e-5 * float(a.abs().max()))
    assert torch.allclose(got_g.double(), _with_tail(gg, 2, rho_g), atol=1e-5 * float(gg.abs().max()))
    assert torch.trace(got_a.double()) == pytest.approx(float(torch.trace(a)), rel=1e-5)  # trace-preserving
    assert cut.metadata["kfac_rank"] == 2 and cut.metadata["kfac_tail"] == "mean"
    assert cut.metadata["derived_from"] == "full" and torch.equal(cut.fisher["b"], anchor.fisher["b"])
    # (6 + 5) x 2 eigenvectors, 2 + 2 eigenvalues, 2 tails, over 5 x 6 parameters
    assert cut.metadata["kfac_floats_per_param"] == pytest.approx((22 + 4 + 2) / 30)
    assert floats_per_param(anchor.kfac) == pytest.approx((36 + 25 + 6 + 5) / 30)  # full rank


def test_a_zero_tail_is_no_tail_and_a_factor_no_wider_than_the_rank_stays_whole(full):
    anchor, a, gg = full
    zero = truncated_anchor(anchor, 2, "zero")
    assert not zero.kfac["w"].tailed and zero.metadata["kfac_tail"] == "zero"
    got_a, _ = zero.kfac_factors("w")
    assert torch.allclose(got_a.double(), _with_tail(a, 2, 0.0), atol=1e-5 * float(a.abs().max()))
    wide = truncated_anchor(anchor, 5, "wide", tail="mean").kfac["w"]  # G is 5 x 5: all of it kept, tail 0
    assert wide.g_values.numel() == 5 and float(wide.g_tail) == 0.0
    assert float(wide.a_tail) == pytest.approx(float(_spectrum(a)[0][5]), rel=1e-5)  # the one left out


@pytest.mark.parametrize("share", [0.3, 0.5, 0.8, 0.95, 1.0])
def test_the_share_rule_keeps_the_fewest_eigenpairs_holding_the_share_of_each_trace(full, share):
    anchor, a, gg = full
    cut = share_truncated_anchor(anchor, share, "share")
    basis = cut.kfac["w"]
    for matrix, values, tail, which in ((a, basis.a_values, basis.a_tail, 0), (gg, basis.g_values, basis.g_tail, 1)):
        spectrum = _spectrum(matrix)[0].tolist()
        rank, held = 0, 0.0
        while held < share * sum(spectrum) and rank < len(spectrum):
            held += spectrum[rank]
            rank += 1
        rank = max(rank, 1)
        assert values.numel() == rank == cut.metadata["kfac_factor_ranks"]["w"][which]
        rest = spectrum[rank:]
        kept_tail = 0.0 if tail is None else float(tail)  # no tail: every eigenpair kept, or tails all 0
        assert kept_tail == pytest.approx(sum(rest) / len(rest) if rest else 0.0, rel=1e-5, abs=1e-7)
    assert cut.metadata["kfac_share"] == share and cut.metadata["kfac_tail"] == "mean"


def test_the_share_rule_refuses_a_share_outside_0_1(full):
    with pytest.raises(ValueError, match="share"):
        share_truncated_anchor(full[0], 80, "share")


def test_the_store_derives_each_truncation_and_lam_comes_from_the_full_anchor(tmp_path):
    model, tokenizer = tiny_model_and_tokenizer()
    plan = replace(TINY, kfac_sizes=(), quality_sequences=(), token_sequences=0)
    store = AnchorStore(model, tokenizer, plan, tmp_path)
    assert store.missing({"math_kfac_t2", "code_kfac_t2"}) == ["code_kfac", "math_kfac"]  # derived: not saved
    arm = Arm("sft", "kfac", 10.0, 0, "code_t2")
    anchors = store.for_arm(plan.anchors_of(arm))
    cut, full = anchors["code_kfac_t2"], anchors["code_kfac"]
    assert cut.metadata["derived_from"] == "code_kfac" and cut.metadata["kfac_tail"] == "mean"
    for name in full.kfac_names:
        kept = full.kfac[name].a_values.double()
        if kept.numel() > 2:
            assert float(cut.kfac[name].a_tail) == pytest.approx(float(kept[2:].mean()), rel=1e-4)
    (callback,) = arm_callbacks(arm, anchors)
    assert list(callback.settings.strength.lam) == pytest.approx([10.0 / full.metadata["statistics"]["p99"]])
    share = store.fetch("math_kfac_s80")
    assert share.metadata["kfac_share"] == 0.8 and share.metadata["derived_from"] == "math_kfac"
    assert not store.fetch("math_kfac_r2").kfac[full.kfac_names[0]].tailed
