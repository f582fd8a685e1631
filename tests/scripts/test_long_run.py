"""`python scripts/long_run.py --tiny` end to end (well under a minute): every arm of the tiny plan (SFT, DPO and
GRPO; every protection, LwF, WiSE-FT, LoRA) trains and is measured at every planned step, each row records its
steps and the items behind every number, the tables and both plots are written, and a second call resumes
without training again. Numbers checked: the base model's KL to itself is exactly 0; the unregularized SFT run
learns its held-out task; WiSE-FT at a = 0.5 is measured without training; no arm's checkpoints are left behind."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.extras import needs
from support.tiny_runs import SCRIPTS, result_rows, run_tiny

needs("trl", "datasets", "peft")

from longrun.data import math_problems  # noqa: E402
from longrun.measure import MATH_EXAMPLES  # noqa: E402
from longrun.plan import TINY  # noqa: E402

pytest.importorskip("matplotlib", reason="the plots need the `demo` extra (matplotlib)")


def run_script(output_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return run_tiny("long_run.py", output_dir, *extra)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("long_run")
    done = run_script(out, "--plot")
    assert done.returncode == 0, done.stderr[-3000:]
    return out, result_rows(out)


def test_every_arm_is_measured_along_its_run_and_at_its_end(tiny_run):
    out, rows = tiny_run
    assert set(rows) == {"base", *(arm.key for arm in TINY.arms())}
    base = rows["base"]["metrics"]
    assert base["math/kl"] == base["code/kl"] == base["safety/kl"] == 0.0
    assert base["math/items"] == TINY.math_items and base["math/kl_items"] == TINY.kl_prompts * TINY.kl_samples
    for arm in TINY.arms():
        row = rows[arm.key]
        if arm.method == "wiseft":
            assert row["steps"] == 0 and row["curve"] == []
            continue
        assert row["steps"] == TINY.steps_of(arm.optimizer)
        assert [p["step"] for p in row["curve"]] == TINY.measured_steps(arm.optimizer)
        assert all(p["math/kl_items"] == TINY.kl_prompts for p in row["curve"])  # one response per prompt
        assert row["metrics"]["seconds_per_step"] > 0 and row["metrics"]["task/items"] == TINY.heldout_prompts
    problems = math_problems(MATH_EXAMPLES)
    for row in rows.values():  # the base model's too
        examples = row["math_examples"]
        assert [(e["prompt"], e["answer"]) for e in examples] == [(p, str(a)) for p, a in problems]
        assert all(isinstance(e["response"], str) for e in examples)
    assert rows["sft/unregularized@0/seed0"]["metrics"]["task/sft_gain"] > 0.1
    assert "task/pirate_gain" in rows["grpo-pirate/unregularized@0/seed0"]["metrics"]
    assert any("lwf_kl" in entry for entry in rows["sft/lwf[math]@1/seed0"]["history"])
    for name in ("long_run.md", "frontier.png", "curves.png", "task.jsonl", "references.pt", "distillation.pt"):
        assert (out / name).exists(), name
    assert list((out / "runs").iterdir()) == []  # an arm's checkpoints go once its row is written


def test_a_second_call_resumes_without_training(tiny_run):
    out, _ = tiny_run
    before = (out / "results.jsonl").read_text()
    again = run_script(out)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (out / "results.jsonl").read_text() == before
    assert "Writing the task" not in again.stdout and "Estimating anchor" not in again.stdout


TIMING = ("seconds", "train_seconds", "seconds_per_step")


def measured(row: dict) -> dict:
    """A row without its timings (what two runs of one arm agree on)."""
    metrics = {k: v for k, v in row["metrics"].items() if k not in TIMING}
    return {**{k: v for k, v in row.items() if k not in TIMING}, "metrics": metrics}


def test_two_workers_share_the_arms_and_measure_what_one_does(tiny_run, tmp_path):
    _, alone = tiny_run
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, str(SCRIPTS / "long_run.py"), "--tiny", "--output-dir", str(tmp_path)]
    workers = [
        subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)
    ]
    outputs = [worker.communicate(timeout=600) for worker in workers]
    assert [worker.returncode for worker in workers] == [0, 0], outputs[0][1][-2000:] + outputs[1][1][-2000:]
    keys = [json.loads(line)["key"] for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert sorted(keys) == sorted(["base", *(arm.key for arm in TINY.arms())])  # each arm once
    trained = [sum(f"{arm.key}: math kl" in out for arm in TINY.arms()) for out, _ in outputs]
    assert min(trained) > 0, trained  # both workers trained arms
    together = result_rows(tmp_path)
    assert {key: measured(row) for key, row in together.items()} == {key: measured(row) for key, row in alone.items()}
