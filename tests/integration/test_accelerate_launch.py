"""CFPCallback through the real `accelerate launch` with the project's DDP config equals one process.

`accelerate launch --config_file scripts/accelerate/ddp.yaml tests/workers/accelerate_launch_worker.py` with
`ACCELERATE_USE_CPU=true` starts 2 gloo processes (DistributedType.MULTI_CPU; without the variable each process
would run alone). The config's `mixed_precision: bf16` is overridden with `--mixed_precision no` on the command
line: bf16 autocast on a CPU rounds differently from one CPU to another (AVX-512 bf16 against AVX2), and with
it the comparison below would measure bf16 rounding, not the distributed code. Everything else (process count,
distributed type, machine) comes from the file users are told to use.

Both ranks must log identical cfp metrics and end with identical parameters, equal within 1e-5 to a one-process
Trainer run of the same global batch (the float32 summation order of the all-reduced gradient is the only
difference; see `check_ddp_equals_one_process`), while the callback's own effect is > 1000x larger.

Logging: a warning that every process would emit alike (a lenient fingerprint mismatch, checked twice on each
rank) is logged once, by the main process only.
"""

from pathlib import Path

import pytest
import torch
from support.distributed import check_ddp_equals_one_process, launch_worker

DDP_CONFIG = Path(__file__).resolve().parents[2] / "scripts" / "accelerate" / "ddp.yaml"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("accelerate_launch")
    run = launch_worker(
        "accelerate_launch_worker.py", out, config_file=DDP_CONFIG, launch_args=["--mixed_precision", "no"]
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


def test_the_launcher_started_two_ddp_processes_in_float32(ranks):
    for r in ranks:
        assert (r["distributed_type"], r["num_processes"]) == ("DistributedType.MULTI_CPU", 2)
        assert r["mixed_precision"] == "no"


def test_both_ranks_equal_one_process_with_the_same_global_batch(ranks, tmp_path):
    diff, effect = check_ddp_equals_one_process([r["params"] for r in ranks], [r["logs"] for r in ranks], tmp_path)
    print(f"accelerate launch DDP vs one process: max |diff| {diff:.3g}, CFP effect {effect:.3g}")


def test_a_warning_shared_by_all_processes_is_logged_once_on_the_main_process(ranks):
    (warning,) = ranks[0]["fingerprint_warnings"]
    assert "Anchor 'math' was computed for another base model" in warning and "different weights" in warning
    assert ranks[1]["fingerprint_warnings"] == []
