"""Several protecting K-FAC anchors through the Trainer and the loop API: the callback's run equals the loop API's,
each step equals a dense float64 solve of the summed proximal map (replayed from the logged path), a run resumed
from a checkpoint is bit-identical to the uninterrupted one, and the iteration count is
logged."""

import copy

import pytest
import torch
from support.anchors import small_estimate
from support.tiny import tiny_llama
from support.training import CrashAfterSave, adamw_loop, checkpointed_run, full_batch_rows, full_batch_trainer_args
from transformers import Trainer

from hf_cfp import CFP, CFPCallback
from hf_cfp.geometry.kronecker.artifact import dense_factors
from hf_cfp.names import SENSITIVE_DRIFT, SUMMED_ITERATIONS

LAMS = [60.0, 20.0]


@pytest.fixture(scope="module")
def anchor_dirs(tmp_path_factory):
    """math at rank 3 with tails, safety at full rank, on other prompts."""
    dirs = [tmp_path_factory.mktemp("math"), tmp_path_factory.mktemp("safety")]
    small_estimate(tiny_llama(), [[1, 2, 3], [4, 5, 6]], "math", rank=3, seed=0).save_pretrained(dirs[0])
    small_estimate(tiny_llama(), [[20, 21], [22, 23, 24]], "safety", seed=1).save_pretrained(dirs[1])
    return [str(d) for d in dirs]


def test_a_resumed_run_is_bit_identical(anchor_dirs, tmp_path):
    def run(output_dir, extra=(), resume=None, lam=LAMS):
        return checkpointed_run(tiny_llama(), output_dir, [CFPCallback(anchor_dirs, lam=lam), *extra], resume)

    straight, logs = run(tmp_path / "straight")
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "crashed", extra=[CrashAfterSave(4)])
    resumed, _ = run(tmp_path / "crashed", resume=True)
    plain, _ = run(tmp_path / "plain", lam=[0.0, 0.0])
    assert all(torch.equal(resumed[n], straight[n]) for n in straight)
    assert max((straight[n] - plain[n]).abs().max().item() for n in plain) > 1e-3  # the correction acted
    logged = [row for row in logs if SUMMED_ITERATIONS.key() in row]
    assert logged and all(row[SUMMED_ITERATIONS.key()] >= 1 for row in logged)
    assert all(SENSITIVE_DRIFT.key(name) in logged[-1] for name in ("math", "safety"))


def test_the_loop_api_follows_the_callback_and_each_step_is_the_dense_solve(anchor_dirs, tmp_path):
    """The loop API's steps replayed: before each correction the proposal D, after it X; every factored weight's X
    equals the dense float64 solve (I + sum_k lam_k kron(G_k, A_k))^-1 D, and the Trainer's callback run ends at
    the loop's weights."""
    base, rows, steps = tiny_llama(), full_batch_rows(), 3
    trained = copy.deepcopy(base)
    args = full_batch_trainer_args(tmp_path, rows, steps)
    Trainer(model=trained, args=args, train_dataset=rows, callbacks=[CFPCallback(anchor_dirs, lam=LAMS)]).train()

    looped = copy.deepcopy(base)
    protector = CFP(looped, anchor_dirs, lam=LAMS)
    theta0 = {n: p.detach().double().clone() for n, p in base.named_parameters()}
    summed = protector.protection.summed.tensors
    assert summed  # every weight both anchors factor
    bases = {t.name: [dense_factors(t.kfac[a]) for a in ("math", "safety")] for t in summed}
    errors = []

    def correct_and_check():
        params = dict(looped.named_parameters())
        proposal = {n: params[n].detach().double() - theta0[n] for n in bases}
        protector.step()
        for n, factors in bases.items():
            system = torch.eye(proposal[n].numel(), dtype=torch.float64)
            for (a, g), lam in zip(factors, LAMS, strict=True):
                system += lam * torch.kron(g.double(), a.double())
            want = torch.linalg.solve(system, proposal[n].reshape(-1))
            got = (params[n].detach().double() - theta0[n]).reshape(-1)
            errors.append(float((got - want).norm() / proposal[n].norm()))

    adamw_loop(looped, rows, steps, after_step=correct_and_check)
    assert len(errors) == steps * len(bases) and max(errors) <= 2e-5
    for (name, p), q in zip(looped.named_parameters(), trained.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6), name
