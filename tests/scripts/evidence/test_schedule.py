"""`reproduce_table.py --list`'s estimate, against its rule written out here: an arm costs the median seconds of
finished rows of its kind, else the optimizer's plain median plus the K-FAC and greedy costs; anchors cost their
sequences (and eigendecompositions, one per pairwise mean). On the committed first run's rows (the state the K-FAC
and RL arms were resumed from), and on the whole committed run (nothing left)."""

import json
import statistics
from pathlib import Path

from support.extras import needs

needs("trl", "datasets")

from evidence.anchors import AnchorStore  # noqa: E402
from evidence.plan import EMBEDDED, Arm, is_new  # noqa: E402
from evidence.schedule import EMBEDDED_COSTS as COSTS  # noqa: E402
from evidence.schedule import anchor_seconds, arm_seconds, remaining  # noqa: E402

COMMITTED = Path(__file__).resolve().parents[3] / "scripts" / "results" / "evidence-smollm2" / "results.jsonl"


BEFORE_SWEEP = 81  # the base row and the 80 arms of issue 25's run, first in the file; the rank and tail sweep follows


def committed(whole: bool = False) -> dict[str, dict]:
    """The committed rows of the run before the rank and tail sweep by key: the first run's (the base and the
    diagonal arms), or with `whole` all of that run's rows (the sweep's rows, committed as it resumes, left out)."""
    rows = [json.loads(line) for line in COMMITTED.read_text().splitlines() if line.strip()][:BEFORE_SWEEP]
    return {r["key"]: r for r in rows if whole or "arm" not in r or not is_new(Arm(**r["arm"]))}


def plain(done: dict, optimizer: str) -> float:
    return statistics.median(
        r["seconds"]
        for r in done.values()
        if "arm" in r and r["arm"]["optimizer"] == optimizer and not EMBEDDED.measures_greedy(Arm(**r["arm"]))
    )


def test_arm_priors_add_the_kfac_costs_to_the_optimizers_plain_median():
    done = committed()
    seconds = arm_seconds(EMBEDDED, done, COSTS)
    assert len(seconds) == 36 + 62 and not set(seconds) & set(done)  # the issue-25 arms and the rank and tail sweep
    steps, sft, dpo = EMBEDDED.steps, plain(done, "sft"), plain(done, "dpo")
    # full-rank protection, binding math_kfac (protecting and monitor), greedy scores
    assert seconds["sft/kfac[math]@1/seed0"] == sft + steps * COSTS.kfac_step + COSTS.kfac_anchor + COSTS.greedy
    # code_kfac protects, math_kfac monitors: two full-rank anchors bound
    assert seconds["dpo/kfac[code]@1/seed1"] == dpo + steps * COSTS.kfac_step + 2 * COSTS.kfac_anchor
    # a truncation is views of math_kfac: only the monitor is read
    assert seconds["sft/kfac[math_r8]@1/seed0"] == sft + steps * COSTS.kfac_truncated_step + COSTS.kfac_anchor
    # no RL row finished: the RL prior, plus the math_kfac monitor
    assert seconds["rloo-pirate/cfp[math]@1/seed0"] == COSTS.rl_arm + COSTS.kfac_anchor


def test_finished_rows_of_the_same_kind_replace_the_prior():
    done = committed()
    for key, spent in (("sft/kfac[code]@1/seed0", 200.0), ("sft/kfac[math_n16]@1/seed0", 300.0)):
        arm = next(a for a in EMBEDDED.arms() if a.key == key)
        done[key] = {"key": key, "arm": arm.__dict__, "metrics": {}, "seconds": spent}
    seconds = arm_seconds(EMBEDDED, done, COSTS)
    assert seconds["sft/kfac[safety]@1/seed1"] == 250.0  # median of the two finished full-rank SFT K-FAC rows
    assert seconds["dpo/kfac[safety]@1/seed1"] != 250.0  # another optimizer: its own prior
    assert seconds["sft/kfac[math_r64]@1/seed0"] < 200.0  # truncated: another kind


def test_anchor_costs_and_the_listing(tmp_path):
    store = AnchorStore(None, None, EMBEDDED, tmp_path / "anchors")
    names = {n for arm in EMBEDDED.arms() for n in EMBEDDED.anchors_of(arm) if "kfac" in n}
    costs = anchor_seconds(store, names, COSTS)
    per_32 = 32 * COSTS.anchor_sequence
    assert costs["math_kfac"] == costs["math_kfac_part3"] == per_32 + COSTS.kfac_decomposition
    assert costs["math_kfac_n16"] == 16 * COSTS.anchor_sequence + COSTS.kfac_decomposition
    assert costs["math_kfac_n64"] == COSTS.kfac_decomposition  # one pairwise mean
    assert costs["math_kfac_n128"] == 2 * COSTS.kfac_decomposition  # its second half and the whole
    assert "math_kfac_r8" not in costs  # derived when loaded
    assert "math_kfac_t8" not in costs and "math_kfac_s90" not in costs
    text = remaining(EMBEDDED, tmp_path, committed(), COSTS)
    assert text.startswith(f"98 arms to run in {tmp_path} (44 done):")
    assert "12 anchors to make first:" in text and text.splitlines()[-1].startswith("references ~120 s; total ~")
    # the whole committed run: the sweep and the default's rows are left (62 arms), needing only the full anchors
    finished = remaining(EMBEDDED, tmp_path, committed(whole=True), COSTS)
    assert finished.startswith(f"62 arms to run in {tmp_path} (80 done):")


def test_truncations_cost_by_tail_a_mean_tail_twice_the_correction_of_a_zero_one():
    assert COSTS.kfac_tailed_step == 2 * COSTS.kfac_truncated_step
    done = committed()  # no K-FAC row finished: the priors
    seconds = arm_seconds(EMBEDDED, done, COSTS)
    steps, sft = EMBEDDED.steps, plain(done, "sft")
    assert seconds["sft/kfac[math_t8]@1/seed0"] == sft + steps * COSTS.kfac_tailed_step + COSTS.kfac_anchor
    assert seconds["sft/kfac[math_s90]@0.3/seed0"] == seconds["sft/kfac[math_t8]@1/seed0"]
    assert seconds["sft/kfac[math_r16]@1/seed0"] == sft + steps * COSTS.kfac_truncated_step + COSTS.kfac_anchor
    # the whole committed run: the zero-tail rows that ran (r8, r64 at c = 1) price their kind; a mean tail is that
    # plus its costlier correction, until a mean-tail row of its own kind ran
    done = committed(whole=True)
    zero = statistics.median(done[f"sft/kfac[math_r{r}]@1/seed0"]["seconds"] for r in (8, 64))
    extra = steps * (COSTS.kfac_tailed_step - COSTS.kfac_truncated_step)
    seconds = arm_seconds(EMBEDDED, done, COSTS)
    assert seconds["sft/kfac[math_r256]@1/seed0"] == zero
    assert seconds["sft/kfac[math_t8]@1/seed0"] == seconds["sft/kfac[math_s50]@1/seed0"] == zero + extra
    arm = Arm("sft", "kfac", 1.0, 0, "math_t8")
    done[arm.key] = {"key": arm.key, "arm": arm.__dict__, "metrics": {}, "seconds": 70.0}
    assert arm_seconds(EMBEDDED, done, COSTS)["sft/kfac[math_s50]@1/seed0"] == 70.0
