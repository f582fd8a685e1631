"""CFPCallback under DeepSpeed ZeRO-2 on 2 CPU processes (torchrun, gloo) equals one process.

Needs the `deepspeed` extra (`pip install deepspeed`) and, on its first run, a one-time build of
DeepSpeed's CPU communication extension (about 4 minutes, cached in ~/.cache/torch_extensions;
scripts/setup.sh builds it). Skipped, saying why, when deepspeed cannot be imported.

One launch of `tests/workers/deepspeed_worker.py` trains ZeRO-2, ZeRO-3 with the default persistence thresholds
(every parameter of the tiny model stays gathered) and ZeRO-3 with every parameter partitioned,
each checked against a single-process Trainer run of the same global batch: gathered parameters
within 1e-5 while the callback's own effect is orders of magnitude larger, metrics the same on
both processes and equal to the single-process ones.

Resuming ZeRO-3 (every parameter partitioned): a new Trainer and callback resuming from a copy of
the real checkpoint saved by the 2 processes end bit-identical to the uninterrupted run, resuming
without its theta0 ends far away; that checkpoint's theta0 restores in this one process, and the
theta0 saved by this process restores on the 2 processes' partitions, exactly.

PEFT LoRA (lam > 0): under ZeRO-2 the corrected LoRA factors reach the fp32 master copy (without that the
next step would copy the uncorrected master back over them), so the run equals one process as above; under
ZeRO-3, which partitions the factors, binding raises a clear CFPError.
"""

import pytest
import torch
from support.distributed import (
    KEYS,
    RESUME_STEP,
    ROWS,
    check_lora_equals_one_process,
    check_pieces_equal_initial,
    check_restores_initial_in_one_process,
    make_callback,
    make_model,
    run_deepspeed_worker,
    save_one_process_theta0,
    trainer_run,
)
from support.extras import requires


@pytest.fixture(scope="module")
def worker_out(tmp_path_factory):
    """The worker's output folder (rank<r>.pt, its checkpoints); before launching, this process saves
    theta0 into one-process/ for the workers to restore."""
    out = tmp_path_factory.mktemp("deepspeed")
    run_deepspeed_worker("deepspeed_worker.py", out, save_one_process_theta0(out / "one-process"))
    return out


@pytest.fixture(scope="module")
def ranks(worker_out):
    return [torch.load(worker_out / f"rank{r}.pt", weights_only=True) for r in range(2)]


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


def test_zero3_resumes_from_a_moved_trainer_checkpoint_bit_identically(ranks):
    """The same DeepSpeed engine code path before and after the checkpoint (fp32 master partitions and
    optimizer state reloaded exactly), so the resumed run equals the uninterrupted one bit for bit."""
    assert ranks[0]["zero3_saved_files"] == [f"cfp_theta0-rank{r:05d}-of-00002.safetensors" for r in range(2)]
    for r in ranks:
        straight = r["zero3_partitioned_params"]
        resumed = max_diff(r["zero3_resumed_params"], straight)
        restarted = max_diff(r["zero3_restarted_params"], straight)  # negative control: about 1.7e-2
        assert resumed == 0 and restarted > 1e-3, (resumed, restarted)
        for key in KEYS:
            assert r["zero3_resumed_logs"][key] == r["zero3_partitioned_logs"][key], key
            assert r["zero3_restarted_logs"][key] != r["zero3_partitioned_logs"][key], key
    assert check_pieces_equal_initial([r["zero3_resumed_theta0"] for r in ranks]) > 0  # partition-sized pieces


def test_zero3_restores_theta0_saved_by_one_process(ranks):
    """Each process's partitions of theta0, read from the directory this process saved (full tensors),
    equal its partitions of the initial weights exactly, though its weights have moved away."""
    pieces = [r["zero3_read_one"] for r in ranks]
    assert check_pieces_equal_initial(pieces) > 0
    trained = ranks[0]["zero3_resumed_params"]
    moved = max((trained[n].reshape(-1)[a:b] - t0).abs().max().item() for n, a, b, t0 in pieces[0] if b > a)
    assert moved > 1e-3, moved


def test_zero3_checkpoint_restores_in_one_process(worker_out):
    """theta0 saved by the 2 ZeRO-3 processes (one file of partitions each), read here on a plain
    model whose weights moved: the initial full weights, exactly."""
    check_restores_initial_in_one_process(worker_out / "zero3_partitioned" / f"checkpoint-{RESUME_STEP}")


@requires("peft")
def test_zero2_lora_carries_the_correction_into_the_master_copy_and_equals_one_process(ranks, tmp_path):
    assert all(r["zero2_lora_master_gap"] == 0.0 for r in ranks)  # master copy == corrected fp32 factors
    check_lora_equals_one_process(
        [r["zero2_lora_params"] for r in ranks], [r["zero2_lora_logs"] for r in ranks], tmp_path
    )


@requires("peft")
def test_zero3_lora_is_refused_with_a_clear_error(ranks):
    for r in ranks:
        error, message = r["zero3_lora_refusal"]
        assert error == "CFPError" and "has sharded LoRA factors" in message, (error, message)
