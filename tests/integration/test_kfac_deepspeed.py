"""K-FAC anchors protecting DeepSpeed ZeRO-2 and ZeRO-3 runs on 2 CPU processes (torchrun, gloo), as one process.

Needs the `deepspeed` extra (skipped, saying why, without it). One launch of `tests/workers/kfac_deepspeed_worker.py`.
Each process corrects the model parameters it holds (ZeRO-2: whole weights; ZeRO-3: partitions that cut rows) and
its fragments of the optimizer's fp32 master copy (flat pieces that cut rows), one all-reduce per weight; the
parameters then equal a one-process Trainer run of the same global batch (atol 1e-5, only the gradient's float
summation order differs) while the K-FAC correction's own effect is far larger, at full rank and at rank 3 with
tails, and every logged metric is the same on both processes and equal to the one-process one. A ZeRO-3 run resumed
from a moved checkpoint ends bit-identical to the uninterrupted one, and its checkpoint's theta0 restores in one
process. Two protecting anchors summed on one K-FAC weight are refused under ZeRO with what to do.
"""

import pytest
import torch
from support.distributed import (
    KEYS,
    RESUME_STEP,
    ROWS,
    SAFETY_PROMPTS,
    check_restores_initial_in_one_process,
    estimate_kfac_anchor,
    make_kfac_callback,
    make_model,
    run_deepspeed_worker,
    trainer_run,
)


@pytest.fixture(scope="module")
def anchors(tmp_path_factory):
    """The saved anchors: K-FAC `math` at full rank (`full`) and at rank 3 with tails (`tailed`), and `safety`."""
    out = tmp_path_factory.mktemp("kfac-deepspeed-anchors")
    estimate_kfac_anchor(make_model()).save_pretrained(out / "full")
    estimate_kfac_anchor(make_model(), rank=3).save_pretrained(out / "tailed")
    estimate_kfac_anchor(make_model(), rank=3, name="safety", prompts=SAFETY_PROMPTS).save_pretrained(out / "safety")
    return {name: out / name for name in ("full", "tailed", "safety")}


@pytest.fixture(scope="module")
def worker_out(anchors, tmp_path_factory):
    out = tmp_path_factory.mktemp("kfac-deepspeed")
    run_deepspeed_worker("kfac_deepspeed_worker.py", out, anchors["full"], anchors["tailed"], anchors["safety"])
    return out


@pytest.fixture(scope="module")
def ranks(worker_out):
    return [torch.load(worker_out / f"rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.fixture(scope="module")
def single(anchors, tmp_path_factory):
    """Per anchor: (parameters, last logs) of one process with the whole global batch; and the unprotected run's
    parameters."""
    out = tmp_path_factory.mktemp("kfac-single")
    runs = {}
    for key in ("full", "tailed"):
        model = make_model()
        logs = trainer_run(model, [make_kfac_callback(anchors[key])], out / key, per_device_batch=ROWS)
        runs[key] = ({n: p.detach() for n, p in model.named_parameters()}, logs)
    plain = make_model()
    trainer_run(plain, [], out / "plain", per_device_batch=ROWS)
    runs["plain"] = {n: p.detach() for n, p in plain.named_parameters()}
    return runs


def max_diff(a, b):
    return max((a[n] - b[n]).abs().max().item() for n in a)


@pytest.mark.parametrize("tag", ["zero2", "zero2_tailed", "zero3", "zero3_tailed", "zero3_persisted_tailed"])
def test_zero_with_kfac_anchor_equals_one_process(ranks, single, tag):
    pieces = [piece for r in ranks for piece in r[f"{tag}_pieces"]]
    assert any(start % width and start < stop for start, stop, _, width in pieces), "no fragment began inside a row"
    params, single_logs = single["tailed" if tag.endswith("_tailed") else "full"]
    two = ranks[0][f"{tag}_params"]
    assert max_diff(two, ranks[1][f"{tag}_params"]) == 0
    diff, effect = max_diff(two, params), max_diff(params, single["plain"])
    assert diff <= 1e-5 and effect > 1000 * max(diff, 1e-7), (tag, diff, effect)
    if tag.startswith("zero2"):  # the master fragments, corrected piece by piece, agree with the whole weights
        assert all(0 <= r[f"{tag}_master_gap"] <= 1e-6 for r in ranks), [r[f"{tag}_master_gap"] for r in ranks]
    for key in KEYS:
        assert ranks[0][f"{tag}_logs"][key] == ranks[1][f"{tag}_logs"][key], (tag, key)
        assert ranks[0][f"{tag}_logs"][key] == pytest.approx(single_logs[key], rel=1e-5), (tag, key)


def test_zero3_with_kfac_anchor_resumes_bit_identically(ranks):
    for r in ranks:
        assert max_diff(r["zero3_tailed_resumed_params"], r["zero3_tailed_params"]) == 0
        for key in KEYS:
            assert r["zero3_tailed_resumed_logs"][key] == r["zero3_tailed_logs"][key], key


def test_zero3_kfac_checkpoint_restores_theta0_in_one_process(worker_out):
    """theta0 saved by the 2 ZeRO-3 processes of the K-FAC run (one file of partitions each), read here on a plain
    model whose weights moved: the initial full weights, exactly."""
    check_restores_initial_in_one_process(worker_out / "zero3_tailed" / f"checkpoint-{RESUME_STEP}")


def test_zero_with_summed_anchors_is_refused_with_what_to_do(ranks):
    for r in ranks:
        kind, message = r["zero2_summed_refusal"]
        assert kind == "CFPArgumentError" and "DeepSpeed ZeRO" in message and "monitor=" in message, message
