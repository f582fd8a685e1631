"""CFPCallback on 2 CPU processes (torchrun, gloo) under DDP, FSDP2 and FSDP1 equals one process.

One launch of `tests/workers/distributed_worker.py` runs all modes (launching costs about 20 s). The gathered
parameters after STEPS steps must equal a single-process run of the same global batch (atol 1e-5),
while the callback's own effect is orders of magnitude larger; the logged drift metrics must be
the global values, the same on both processes, and match references computed here in float64.

Resuming: in every mode a run interrupted after RESUME_STEP steps and resumed by a new callback
from the theta0 saved by the 2 processes ends bit-identical to the uninterrupted 2-process run,
while resuming without the saved theta0 ends far from it. Across process counts: the FSDP2/FSDP1
runs resumed by 2 processes from theta0 saved by this one process, and a one-process run resumed
here from theta0 saved by the 2 processes, end bit-identical to the uninterrupted run of the same
process count; restored theta0 equals the initial weights piece by piece, exactly.

PEFT LoRA (lam > 0): under DDP the LoRA factors and the lm_head copy end within 1e-5 of one process (the
same bound as the full model: only the gradient all-reduce's float summation order differs, and the
correction is a deterministic function of the replicated factors), the metrics equal the one-process ones
and a float64 reference of the merged weights; sharded by FSDP2 or FSDP1, binding raises a clear CFPError.
"""

import math
import re
import shutil

import pytest
import torch
from support.distributed import (
    KEYS,
    KL_BUDGET,
    LAM,
    LORA_KEYS,
    RESUME_STEP,
    ROWS,
    Resume,
    check_ddp_equals_one_process,
    check_lora_equals_one_process,
    check_pieces_equal_initial,
    initial_params,
    loop_run,
    make_callback,
    make_model,
    make_rows,
    make_state,
    random_fisher,
    restored_in_one_process,
    run_worker,
    save_one_process_theta0,
    trainer_run,
)
from support.extras import requires

from hf_cfp import CFPError
from hf_cfp.protection import SavedTheta0

LOOP_MODES = ("fsdp2", "fsdp1", "fsdp1flat")


@pytest.fixture(scope="module")
def worker_out(tmp_path_factory):
    """The worker's output folder: rank<r>.pt and the theta0 directories it saved. Before launching,
    this process saves theta0 into one-process/ for the workers to restore."""
    out = tmp_path_factory.mktemp("distributed")
    one = save_one_process_theta0(out / "one-process")
    run = run_worker("distributed_worker.py", out, one)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def ranks(worker_out):
    return [torch.load(worker_out / f"rank{r}.pt", weights_only=True) for r in range(2)]


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
    check_ddp_equals_one_process([r["ddp_params"] for r in ranks], [r["ddp_logs"] for r in ranks], tmp_path)
    check_metrics(ranks, "ddp", initial_params())


@pytest.mark.parametrize("rule", ["adaptive", "feedforward"])
def test_ddp_kl_budget_holds_lam_replicated_and_equals_one_process(ranks, tmp_path, rule):
    """kl_budget measured every step under DDP: both processes log the same measured KL and lam and end with the
    same weights, within 1e-5 of a one-process run of the same global batch, whose controller moved lam (the
    feed-forward rule: solved at every step on the process's own proposal, the same on both)."""
    model = make_model()
    callback = make_callback(model, **KL_BUDGET, kl_control=rule)
    single_logs = trainer_run(model, [callback], tmp_path / "one", per_device_batch=ROWS)
    (logs, params) = zip(*(r["ddp_kl"][rule] for r in ranks), strict=True)
    for key in ("cfp/math/measured_kl", "cfp/math/lam"):
        assert logs[0][key] == logs[1][key], key
        # the measured KL: a mean of differences of float32 log-probs of a few nats each, near 0 here
        assert logs[0][key] == pytest.approx(single_logs[key], rel=1e-5, abs=1e-6), key
    assert single_logs["cfp/math/lam"] != LAM  # the controller acted
    assert max_diff(params[0], params[1]) == 0
    single = {n: p.detach() for n, p in model.named_parameters()}
    assert max_diff(params[0], single) <= 1e-5


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


def check_resumed(ranks, mode):
    """The interrupted-and-resumed run of `mode` equals the uninterrupted 2-process run bit for bit
    (parameters and logged drift metrics) and restored theta0 = the initial weights; the negative
    control (resumed without theta0) ends measurably away. Returns (resumed gap, negative-control gap)."""
    gaps = []
    for r in ranks:
        straight = r[f"{mode}_params"]
        assert r[f"{mode}_resumed_params"].keys() == straight.keys()
        gaps.append(
            (max_diff(r[f"{mode}_resumed_params"], straight), max_diff(r[f"{mode}_restarted_params"], straight))
        )
        for key in KEYS:
            assert r[f"{mode}_resumed_logs"][key] == r[f"{mode}_logs"][key], (mode, key)
            assert r[f"{mode}_restarted_logs"][key] != r[f"{mode}_logs"][key], (mode, key)
    resumed, restarted = max(g for g, _ in gaps), min(g for _, g in gaps)
    assert resumed == 0 and restarted > 1e-3, (mode, gaps)  # negative control: about 1.7e-2 (DDP), 3.2e-2
    return resumed, restarted


def test_ddp_resumes_from_a_moved_trainer_checkpoint_bit_identically(ranks):
    """A new Trainer and callback resume from a copy of checkpoint-RESUME_STEP into a fresh output_dir:
    the same Trainer code path as the uninterrupted run (weights, optimizer, scheduler, RNG and theta0
    reloaded exactly), so equal bit for bit."""
    assert ranks[0]["ddp_saved_files"] == ["cfp_theta0-rank00000-of-00002.safetensors"]  # replicated: once
    check_resumed(ranks, "ddp")
    check_pieces_equal_initial([r["ddp_resumed_theta0"] for r in ranks], whole=True)


@pytest.mark.parametrize("mode", LOOP_MODES)
def test_loop_layout_resumes_bit_identically(ranks, mode):
    """Cut after RESUME_STEP steps, theta0 saved by both processes, resumed by a new callback on the
    same model and optimizer: the same code path as the uninterrupted run, so equal bit for bit."""
    assert ranks[0][f"{mode}_saved_files"] == [f"cfp_theta0-rank{r:05d}-of-00002.safetensors" for r in range(2)]
    check_resumed(ranks, mode)
    assert check_pieces_equal_initial([r[f"{mode}_resumed_theta0"] for r in ranks]) > 0  # sharded pieces
    initial = initial_params()  # the negative control restarted theta0 at the step-2 weights
    assert any(
        not torch.equal(t0, initial[n].reshape(-1)[a:b]) for n, a, b, t0 in ranks[0][f"{mode}_restarted_theta0"]
    )


@pytest.mark.parametrize("mode", LOOP_MODES)
def test_two_processes_resume_from_a_one_process_checkpoint_bit_identically(ranks, mode):
    """Resumed by the 2 processes from the theta0 this process saved (one file of full tensors): each
    reads its pieces from it, and the run equals the uninterrupted 2-process run bit for bit."""
    for r in ranks:
        assert max_diff(r[f"{mode}_from_one_params"], r[f"{mode}_params"]) == 0, mode
        for key in KEYS:
            assert r[f"{mode}_from_one_logs"][key] == r[f"{mode}_logs"][key], (mode, key)
    assert check_pieces_equal_initial([r[f"{mode}_from_one_theta0"] for r in ranks]) > 0


@pytest.fixture(scope="module")
def one_process_loop():
    """(parameters, logs) of the uninterrupted one-process loop run."""
    model = make_model()
    logs = loop_run(model, make_callback(model), make_rows())
    return {n: p.detach() for n, p in model.named_parameters()}, logs


@pytest.mark.parametrize("mode", LOOP_MODES)
def test_one_process_resumes_from_a_two_process_checkpoint_bit_identically(ranks, worker_out, one_process_loop, mode):
    """Resumed here, in one process, from the theta0 the 2 processes of `mode` saved (two files of
    pieces): bit-identical to the uninterrupted one-process run, so within 1e-5 of the 2-process one."""
    model = make_model()
    resume = Resume(RESUME_STEP, worker_out / f"{mode}_resumed", make_callback(make_model()), save=False)
    logs = loop_run(model, make_callback(model), make_rows(), resume)
    resumed = {n: p.detach() for n, p in model.named_parameters()}
    straight, straight_logs = one_process_loop
    assert max_diff(resumed, straight) == 0, mode
    assert all(logs[key] == straight_logs[key] for key in KEYS), mode
    assert max_diff(resumed, ranks[0][f"{mode}_params"]) <= 1e-5, mode


@pytest.mark.parametrize("mode", LOOP_MODES)
def test_theta0_saved_by_one_process_restores_under_two(ranks, mode):
    """theta0 written by this process (full tensors, one file) and by FSDP2 (dim-0 shards, two files),
    restored on the trained model of `mode`: each rank's pieces equal its pieces of the initial
    weights exactly, though the weights it holds have moved away from them."""
    for key in ("one", "fsdp2"):
        pieces = [r[f"{mode}_read_{key}"] for r in ranks]
        assert check_pieces_equal_initial(pieces) > 0, (mode, key)
        trained = ranks[0][f"{mode}_resumed_params"]
        moved = max((trained[n].reshape(-1)[a:b] - t0).abs().max().item() for n, a, b, t0 in pieces[0] if b > a)
        assert moved > 1e-3, (mode, key, moved)  # not a snapshot of the current weights


@pytest.mark.parametrize("mode", LOOP_MODES)
def test_theta0_saved_by_two_processes_restores_in_one(worker_out, mode):
    """The checkpoint saved by the 2 processes, read here on a plain model whose weights moved:
    theta0 = the initial full weights, exactly."""
    state = restored_in_one_process(worker_out / f"{mode}_resumed")
    initial = initial_params()
    assert state.names == list(initial) and not any(t.sharded for t in state.tensors)
    assert all(torch.equal(t0, initial[n]) for n, t0 in zip(state.names, state.theta0, strict=True))


def test_a_checkpoint_missing_a_process_file_is_an_error_naming_the_parameter(worker_out, tmp_path):
    """The FSDP2 checkpoint without rank 1's file, restored in one process: CFPError before training."""
    partial = tmp_path / "checkpoint"
    shutil.copytree(worker_out / "fsdp2_resumed", partial)
    (partial / "cfp_theta0-rank00001-of-00002.safetensors").unlink()
    first = next(iter(initial_params()))
    with pytest.raises(CFPError, match=rf"does not cover parameter {re.escape(repr(first))} .*cfp_theta0-rank\*"):
        make_state(make_model(), theta0=SavedTheta0(partial))


@requires("peft")
def test_ddp_lora_equals_one_process(ranks, tmp_path):
    check_lora_equals_one_process([r["lora_ddp_params"] for r in ranks], [r["lora_ddp_logs"] for r in ranks], tmp_path)


@requires("peft")
def test_ddp_lora_resumes_bit_identically_from_the_factors_rank_0_saved(ranks):
    """theta0 of the lm_head copy and the LoRA factors at train begin are replicated: rank 0 writes them once,
    both processes read them back, and the resumed run equals the uninterrupted one bit for bit."""
    assert ranks[0]["lora_ddp_saved_files"] == ["cfp_theta0-rank00000-of-00002.safetensors"]
    for r in ranks:
        assert r["lora_ddp_resumed_params"].keys() == r["lora_ddp_params"].keys()
        assert all(torch.equal(p, r["lora_ddp_params"][n]) for n, p in r["lora_ddp_resumed_params"].items())
        assert all(r["lora_ddp_resumed_logs"][key] == r["lora_ddp_logs"][key] for key in ("loss", *LORA_KEYS))


@requires("peft")
@pytest.mark.parametrize("kind, says", [("fsdp2", "has sharded LoRA factors"), ("fsdp1", "under FSDP1")])
def test_sharded_lora_factors_are_refused_with_a_clear_error(ranks, kind, says):
    for r in ranks:
        error, message = r[f"lora_{kind}_refusal"]
        assert error == "CFPError" and says in message, (kind, error, message)
