"""K-FAC anchors on 2 CPU processes (torchrun, gloo): estimated, and protecting DDP and FSDP2 runs, as one process.

One launch of `tests/workers/kfac_distributed_worker.py`. The anchor estimated by 2 processes (batches split, the
factor sums all-reduced) equals the one-process anchor; the parameters trained under DDP and FSDP2 equal a
one-process run of the same global batch (atol 1e-5: only the gradient's float summation order differs, as for
diagonal anchors in test_distributed.py), while the K-FAC correction's own effect is far larger; the logged
metrics are the same on both processes and equal the one-process ones; so do FSDP1's (use_orig_params True and
False), whose flat pieces cut rows. Two summed anchors on FSDP1's pieces are refused.
Communication per step under FSDP2: one all-reduce of the rotated blocks (r_G x r_A floats per weight) for the
correction, one more at a logging step.
"""

import pytest
import torch
from support.distributed import (
    KEYS,
    ROWS,
    SAFETY_PROMPTS,
    estimate_kfac_anchor,
    loop_run,
    make_kfac_callback,
    make_model,
    make_rows,
    run_worker,
    trainer_run,
)

from hf_cfp.geometry.kronecker import factors as kfac_factors


@pytest.fixture(scope="module")
def kfac_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("kfac-anchor")
    estimate_kfac_anchor(make_model()).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def tailed_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("kfac-tailed-anchor")
    anchor = estimate_kfac_anchor(make_model(), rank=3)
    assert all(basis.tailed for basis in anchor.kfac.values())
    anchor.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def safety_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("kfac-safety-anchor")
    estimate_kfac_anchor(make_model(), rank=3, name="safety", prompts=SAFETY_PROMPTS).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def anchors(kfac_dir, tailed_dir, safety_dir):
    """What protects each run: one K-FAC anchor (full rank, rank 3 with tails), or two summed (`_summed`)."""
    return {"": kfac_dir, "_tailed": tailed_dir, "_summed": [tailed_dir, safety_dir]}


@pytest.fixture(scope="module")
def ranks(kfac_dir, tailed_dir, safety_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("kfac-distributed")
    run = run_worker("kfac_distributed_worker.py", out, kfac_dir, tailed_dir, safety_dir)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


def trainable(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def max_diff(a, b):
    return max((a[n] - b[n]).abs().max().item() for n in a)


def test_two_processes_estimate_the_one_process_anchor(ranks):
    single = estimate_kfac_anchor(make_model())
    for r in ranks:
        assert sorted(r["estimated"]) == sorted(single.kfac_names)
        for name, (a, g) in r["estimated"].items():
            want_a, want_g = single.kfac_factors(name)
            assert torch.allclose(a, want_a, rtol=1e-4, atol=1e-6 * float(want_a.abs().max())), name
            assert torch.allclose(g, want_g, rtol=1e-4, atol=1e-6 * float(want_g.abs().max())), name
        for name, f in r["estimated_fisher"].items():
            assert torch.allclose(f, single.fisher[name], rtol=1e-5, atol=1e-12), name


def check_equal_to_one_process(ranks, mode, single, single_logs, plain):
    two = ranks[0][f"{mode}_params"]
    assert max_diff(two, ranks[1][f"{mode}_params"]) == 0  # every process made the same correction
    diff, effect = max_diff(two, single), max_diff(single, plain)
    assert diff <= 1e-5 and effect > 1000 * max(diff, 1e-7), (mode, diff, effect)
    keys = (*KEYS, "cfp/safety/sensitive_drift", "cfp/safety/free_drift") if mode.endswith("_summed") else KEYS
    for key in keys:
        assert ranks[0][f"{mode}_logs"][key] == ranks[1][f"{mode}_logs"][key], (mode, key)
        assert ranks[0][f"{mode}_logs"][key] == pytest.approx(single_logs[key], rel=1e-5), (mode, key)


def test_sketched_factors_on_two_processes_equal_one_process(ranks, monkeypatch):
    """Factors wider than 20 sketched (all-reduced sketches, refined by a second pass on each process's own
    sequences) give the one-process factors (A_r, G_r with their tails)."""
    monkeypatch.setattr(kfac_factors, "MAX_FORMED_DIMENSION", 20)
    single = estimate_kfac_anchor(make_model(), rank=3)
    for r in ranks:
        for name, (a, g) in r["sketched"].items():
            want_a, want_g = single.kfac_factors(name)
            assert torch.allclose(a, want_a, rtol=1e-3, atol=1e-4 * float(want_a.abs().max())), name
            assert torch.allclose(g, want_g, rtol=1e-3, atol=1e-4 * float(want_g.abs().max())), name


@pytest.mark.parametrize("suffix", ["", "_tailed", "_summed"])
def test_ddp_equals_one_process(ranks, anchors, suffix, tmp_path):
    """Each factored batch (each summed weight) corrected by one process (both own some), the corrected weights
    shared."""
    owned = [r[f"ddp{suffix}_owned"][-1 if suffix == "_summed" else 0] for r in ranks]
    assert all(count > 0 for count in owned)
    model = make_model()
    callbacks = [make_kfac_callback(anchors[suffix])]
    single_logs = trainer_run(model, callbacks, tmp_path / "one", per_device_batch=ROWS)
    plain = make_model()
    trainer_run(plain, [], tmp_path / "plain", per_device_batch=ROWS)
    check_equal_to_one_process(ranks, f"ddp{suffix}", trainable(model), single_logs, trainable(plain))


@pytest.mark.parametrize("suffix", ["", "_tailed", "_summed"])
def test_fsdp2_rotates_row_shards_and_equals_one_process(ranks, anchors, suffix):
    sharded = ranks[0][f"fsdp2{suffix}_sharded"]
    assert sharded and sharded == ranks[1][f"fsdp2{suffix}_sharded"]
    summed = ranks[0][f"fsdp2{suffix}_summed"]
    assert bool(summed) == (suffix == "_summed") and set(sharded) <= set(summed or sharded)
    model = make_model()
    single_logs = loop_run(model, make_kfac_callback(anchors[suffix]), make_rows())
    plain = make_model()
    loop_run(plain, None, make_rows())
    check_equal_to_one_process(ranks, f"fsdp2{suffix}", trainable(model), single_logs, trainable(plain))


@pytest.mark.parametrize("mode", ["fsdp1", "fsdp1flat"])
@pytest.mark.parametrize("suffix", ["", "_tailed"])
def test_fsdp1_corrects_flat_pieces_that_cut_rows_and_equals_one_process(ranks, anchors, mode, suffix):
    cut = [r[f"{mode}{suffix}_cut"] for r in ranks]
    assert any(cut), "no piece cut a row: the test would not exercise the reduce of M"
    for r in ranks:  # each process binds U_G's rows for the rows its piece touches, no more
        for start, stop, width, bound in r[f"{mode}{suffix}_rows"]:
            assert bound == (-(-stop // width) - start // width if stop > start else 0), (start, stop, width, bound)
    model = make_model()
    single_logs = loop_run(model, make_kfac_callback(anchors[suffix]), make_rows())
    plain = make_model()
    loop_run(plain, None, make_rows())
    check_equal_to_one_process(ranks, f"{mode}{suffix}", trainable(model), single_logs, trainable(plain))


def test_fsdp1_with_summed_anchors_is_refused_with_what_to_do(ranks):
    for r in ranks:
        kind, message = r["fsdp1_summed_refusal"]
        assert kind == "CFPArgumentError" and "flat piece" in message and "FSDP2" in message
