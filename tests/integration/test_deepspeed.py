"""CFPCallback under DeepSpeed ZeRO-2 on 2 CPU processes (torchrun, gloo) equals one process.

Needs the `deepspeed` extra (`pip install deepspeed`) and, on its first run, a one-time build of
DeepSpeed's CPU communication extension (about 4 minutes, cached in ~/.cache/torch_extensions;
scripts/setup.sh builds it). Skipped, saying why, when deepspeed cannot be imported.

One launch of `tests/workers/deepspeed_worker.py` trains ZeRO-2, ZeRO-3 with the default persistence thresholds
(every parameter of the tiny model stays gathered) and ZeRO-3 with every parameter partitioned,
each checked against a single-process Trainer run of the same global batch: gathered parameters
within 1e-5 while the callback's own effect is orders of magnitude larger, metrics the same on
both processes and equal to the single-process ones.
"""

import pytest
import torch
from support.distributed import ROWS, make_callback, make_model, run_worker, trainer_run

KEYS = (
    "cfp/math/sensitive_drift",
    "cfp/math/free_drift",
    "cfp/code/sensitive_drift",
    "cfp/code/free_drift",
    "cfp/total_drift",
)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    # Imported here, not at collection: importing deepspeed takes seconds, and only this module needs it.
    pytest.importorskip(
        "deepspeed",
        reason="DeepSpeed is not installed or fails to import (pip install deepspeed)",
        exc_type=ImportError,
    )
    out = tmp_path_factory.mktemp("deepspeed")
    run = run_worker(
        "deepspeed_worker.py",
        out,
        timeout=900,  # the first run builds a C++ extension
        env={"DS_ACCELERATOR": "cpu", "ACCELERATE_USE_DEEPSPEED": "true"},
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


def max_diff(a, b):
    return max((a[n] - b[n]).abs().max().item() for n in a)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """(parameters, last logs) of one process with the whole global batch, and the callback's effect."""
    out = tmp_path_factory.mktemp("single")
    model = make_model()
    logs = trainer_run(model, [make_callback(model)], out / "one", per_device_batch=ROWS)
    params = {n: p.detach() for n, p in model.named_parameters()}
    plain_model = make_model()
    trainer_run(plain_model, [], out / "plain", per_device_batch=ROWS)
    return params, logs, max_diff(params, {n: p.detach() for n, p in plain_model.named_parameters()})


def check_equal_to_one_process(ranks, single, tag):
    params, single_logs, effect = single
    assert max_diff(ranks[0][f"{tag}_params"], ranks[1][f"{tag}_params"]) == 0
    diff = max_diff(ranks[0][f"{tag}_params"], params)
    assert diff <= 1e-5 and effect > 1000 * max(diff, 1e-7), (tag, diff, effect)
    logs = [r[f"{tag}_logs"] for r in ranks]
    for key in KEYS:
        assert logs[0][key] == logs[1][key], (tag, key, logs[0][key], logs[1][key])
        assert logs[0][key] == pytest.approx(single_logs[key], rel=1e-5), (tag, key)


def test_zero2_equals_one_process(ranks, single):
    assert all(r["zero2_optimizer"] == "DeepSpeedZeroOptimizer" for r in ranks), "ZeRO-2 was not active"
    total = sum(p.numel() for p in make_model().parameters())
    assert sum(r["zero2_master_numel"] for r in ranks) == total  # each rank corrects its own master partition
    assert all(r["zero2_master_gap"] == 0.0 for r in ranks)  # master copy == corrected fp32 parameters
    check_equal_to_one_process(ranks, single, "zero2")


@pytest.mark.parametrize("tag", ["zero3", "zero3_partitioned"])
def test_zero3_equals_one_process_with_partition_sized_state(ranks, single, tag):
    params = list(make_model().parameters())
    total = sum(p.numel() for p in params)
    persisted = [r[f"{tag}_persisted"] for r in ranks]
    assert persisted == ([len(params)] * 2 if tag == "zero3" else [0, 0]), persisted  # thresholds as intended
    owned = [r[f"{tag}_owned"] for r in ranks]
    assert sum(t0 for t0, _ in owned) == total and all(t0 == f for t0, f in owned), owned
    check_equal_to_one_process(ranks, single, tag)
