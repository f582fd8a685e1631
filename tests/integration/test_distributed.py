"""CFPCallback on 2 CPU processes (torchrun, gloo) under DDP, FSDP2 and FSDP1 equals one process.

One launch of `tests/workers/distributed_worker.py` runs all modes (launching costs about 20 s). The gathered
parameters after STEPS steps must equal a single-process run of the same global batch (atol 1e-5),
while the callback's own effect is orders of magnitude larger; the logged drift metrics must be
the global values, the same on both processes, and match references computed here in float64.
"""

import math

import pytest
import torch
from support.distributed import (
    ROWS,
    loop_run,
    make_callback,
    make_model,
    make_rows,
    random_fisher,
    run_worker,
    trainer_run,
)

KEYS = (
    "cfp/math/sensitive_drift",
    "cfp/math/free_drift",
    "cfp/code/sensitive_drift",
    "cfp/code/free_drift",
    "cfp/total_drift",
)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("distributed")
    run = run_worker("distributed_worker.py", out)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


def reference_metrics(theta0, params):
    """The drift metrics from full parameters, in float64, by a plain sum and a sort of all F."""
    base = make_model()
    fishers = {"math": random_fisher(base, seed=1), "code": random_fisher(base, seed=2, keep=lambda n: "mlp" in n)}
    metrics = {}
    for name, fisher in fishers.items():
        delta = torch.cat([(params[n].double() - theta0[n].double()).reshape(-1) for n in fisher])
        f = torch.cat([fisher[n].double().reshape(-1) for n in fisher])
        free = torch.argsort(f)[: math.ceil(0.99 * f.numel())]  # F values are distinct
        metrics[f"cfp/{name}/sensitive_drift"] = float((f * delta**2).sum().sqrt())
        metrics[f"cfp/{name}/free_drift"] = float(delta[free].norm())
    metrics["cfp/total_drift"] = float(
        torch.cat([(params[n] - theta0[n]).double().reshape(-1) for n in params]).norm()
    )
    return metrics


def max_diff(a, b):
    return max((a[n] - b[n]).abs().max().item() for n in a)


def check_metrics(ranks, mode, theta0):
    logs = [r[f"{mode}_logs"] for r in ranks]
    reference = reference_metrics(theta0, ranks[0][f"{mode}_params"])
    for key in KEYS:
        assert logs[0][key] == logs[1][key], (mode, key, logs[0][key], logs[1][key])
        assert logs[0][key] == pytest.approx(reference[key], rel=1e-5), (mode, key)
    return logs[0]


def test_ddp_trainer_equals_one_process(ranks, tmp_path):
    theta0 = {n: p.detach().clone() for n, p in make_model().named_parameters()}
    model = make_model()
    single_logs = trainer_run(model, [make_callback(model)], tmp_path / "one", per_device_batch=ROWS)
    single = {n: p.detach() for n, p in model.named_parameters()}
    plain_model = make_model()
    trainer_run(plain_model, [], tmp_path / "plain", per_device_batch=ROWS)
    plain = {n: p.detach() for n, p in plain_model.named_parameters()}

    assert max_diff(ranks[0]["ddp_params"], ranks[1]["ddp_params"]) == 0  # the same correction everywhere
    diff, effect = max_diff(ranks[0]["ddp_params"], single), max_diff(single, plain)
    assert diff <= 1e-5 and effect > 1000 * max(diff, 1e-7), (diff, effect)
    logs = check_metrics(ranks, "ddp", theta0)
    for key in KEYS:
        assert logs[key] == pytest.approx(single_logs[key], rel=1e-5), key


def matches_single_loop_run(ranks, mode):
    """Both ranks' gathered parameters equal each other and a one-process run of the same plain loop
    (atol 1e-5) while the callback's effect is > 1000x larger; metrics equal the one-process ones.
    Returns theta0."""
    theta0 = {n: p.detach().clone() for n, p in make_model().named_parameters()}
    model = make_model()
    single_logs = loop_run(model, make_callback(model), make_rows())
    single = {n: p.detach() for n, p in model.named_parameters()}
    plain_model = make_model()
    loop_run(plain_model, None, make_rows())
    plain = {n: p.detach() for n, p in plain_model.named_parameters()}

    assert ranks[0][f"{mode}_params"].keys() == single.keys()
    assert max_diff(ranks[0][f"{mode}_params"], ranks[1][f"{mode}_params"]) == 0
    diff, effect = max_diff(ranks[0][f"{mode}_params"], single), max_diff(single, plain)
    assert diff <= 1e-5 and effect > 1000 * max(diff, 1e-7), (diff, effect)
    logs = check_metrics(ranks, mode, theta0)
    for key in KEYS:
        assert logs[key] == pytest.approx(single_logs[key], rel=1e-5), key
    return theta0


def test_fsdp2_equals_one_process_with_shard_sized_state(ranks):
    assert all(r["fsdp2_all_dtensor"] and r["fsdp2_all_sharded"] for r in ranks), "FSDP2 did not shard"
    theta0 = matches_single_loop_run(ranks, "fsdp2")

    # Each process keeps theta0 and F for its shard only: (local numel, F numel, F bytes, theta0 numel).
    for name, p in theta0.items():
        per_rank = [r["fsdp2_owned"][name] for r in ranks]
        assert sum(local for local, *_ in per_rank) == p.numel(), name
        for local, f_numel, f_bytes, t0_numel in per_rank:
            assert f_numel == t0_numel == local and f_bytes == 4 * local, (name, per_rank)
    total = sum(p.numel() for p in theta0.values())
    for r in ranks:
        assert 0.45 * total <= sum(local for local, *_ in r["fsdp2_owned"].values()) <= 0.55 * total


def test_fsdp1_orig_params_equals_one_process_with_piece_sized_state(ranks):
    assert all(r["fsdp1_active"] and r["fsdp1_all_sharded"] for r in ranks), "FSDP1 did not flatten and shard"
    assert any(r["fsdp1_empty"] for r in ranks), "some parameter should be empty on some process"
    theta0 = matches_single_loop_run(ranks, "fsdp1")

    # Each process keeps theta0 and F for its piece of the flat parameter only: (local, F, theta0 numel).
    for name, p in theta0.items():
        per_rank = [r["fsdp1_owned"][name] for r in ranks]
        assert sum(local for local, *_ in per_rank) == p.numel(), (name, per_rank)
        assert all(local == f_numel == t0_numel for local, f_numel, t0_numel in per_rank), (name, per_rank)


def test_fsdp1_flat_params_equals_one_process(ranks):
    """use_orig_params=False: each piece is corrected through a view of the local flat shard."""
    assert all(r["fsdp1flat_active"] and r["fsdp1flat_all_sharded"] for r in ranks), "FSDP1 flat not sharded"
    theta0 = matches_single_loop_run(ranks, "fsdp1flat")
    for name, p in theta0.items():  # F and theta0 per process: its piece only, the pieces cover p
        per_rank = [r["fsdp1flat_owned"][name] for r in ranks]
        assert all(f == t0 for f, t0 in per_rank) and sum(f for f, _ in per_rank) == p.numel(), (name, per_rank)
