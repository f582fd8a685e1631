"""CFP on CUDA tensors, against float64 CPU references: the correction, the drift metrics, Fisher estimation and
one Trainer run. Marked `cuda` and skipped where torch sees no CUDA device; `scripts/gpu_check.sh` runs them.

Precision, from the formats alone (as in the CPU tests): the correction computes in float32 and rounds once to
the parameter's bf16, so each element is within one bf16 rounding (relative 2^-8, 8 significant bits) of the
float64 formula, plus a few float32 roundings of the operands' magnitude 4 eps32 (|p| + |t0|) where the result
nearly cancels. The metrics take Delta = theta - theta0 in float32 (exact for bf16 operands), square it and
multiply by F in float32 (two roundings) and sum in float64: relative 1e-6 of a float64 loop.
"""

import copy
import math

import pytest
import torch
from support.anchors import random_anchor
from support.references import StepReference, assert_metrics_match, drift_reference, train_a_little
from support.tiny import tiny_llama
from support.training import last_cfp_logs, short_run

from hf_cfp import CFPCallback, estimate_fisher
from hf_cfp.fisher.sampling import SamplingSettings
from hf_cfp.ops import proximal_pull_
from hf_cfp.protection import CFPState, MemoryPlan

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: torch.cuda.is_available() is false"),
]

CUDA = torch.device("cuda")
EPS32 = torch.finfo(torch.float32).eps
PLANS = {
    "dense": MemoryPlan(),
    "bf16_fisher": MemoryPlan(fisher_dtype="bfloat16"),
    "sparse": MemoryPlan(sparse=0.01),  # theta0 and F for the metrics in pinned CPU memory
}
LAM = 0.5  # F ~ 3 |N(0, 1)|: pulls w = lam F / (1 + lam F) across (0, 0.9)


def assert_one_bf16_rounding(got: torch.Tensor, want: torch.Tensor, proposal: torch.Tensor, theta0: torch.Tensor):
    """`got` (bf16, any device) within one bf16 rounding of the float64 `want`, plus 4 float32 roundings of the
    operands (|p| + |t0|) where the result cancels; every argument but `got` float64 on the CPU."""
    gap = (got.double().cpu() - want).abs()
    bound = 2**-8 * want.abs() + 4 * EPS32 * (proposal.abs() + theta0.abs())
    assert bool((gap <= bound).all()), f"largest gap {float((gap / bound).max()):.2f} x the bound"


def kept_fisher(fisher: dict[str, torch.Tensor], share: float) -> dict[str, torch.Tensor]:
    """F where the sparse plan corrects (F above the ceil((1 - share) n)-th smallest F, by enumeration), 0
    elsewhere: the F the sparse correction applies."""
    values = torch.cat([f.reshape(-1) for f in fisher.values()]).sort().values
    threshold = values[math.ceil((1 - share) * values.numel()) - 1]
    return {n: f.where(f > threshold, 0.0) for n, f in fisher.items()}


def applied_fisher(fisher: dict[str, torch.Tensor], plan: MemoryPlan) -> dict[str, torch.Tensor]:
    """float64 CPU: F as `plan` stores it (rounded to its fisher dtype), zero where a sparse plan corrects not."""
    stored = {n: f.to(getattr(torch, plan.fisher_dtype)).double() for n, f in fisher.items()}
    return kept_fisher(stored, plan.sparse) if plan.sparse is not None else stored


def bound_state(plan: MemoryPlan):
    """A bf16 tiny Llama on CUDA, its anchor, and a CFPState with `plan` bound to it; theta0 (float64 CPU)."""
    model = tiny_llama().to(CUDA, torch.bfloat16)
    anchor = random_anchor(model)
    theta0 = {n: p.detach().double().cpu() for n, p in model.named_parameters()}
    return model, anchor, CFPState(model, anchor, memory=plan), theta0


def test_proximal_pull_on_cuda_bf16_against_float64():
    """`ops.proximal_pull_` on CUDA: bf16 parameters and theta0, anchor 0's F in bf16, anchor 1's in float32 on
    the first tensor only, spans of 1000 elements (several per tensor)."""
    g = torch.Generator().manual_seed(0)
    shapes = [(64, 48), (2500,)]
    params = [torch.randn(s, generator=g).bfloat16() for s in shapes]
    theta0 = [(p.float() + torch.randn(p.shape, generator=g)).bfloat16() for p in params]
    fishers = [
        [torch.rand(shapes[0], generator=g).bfloat16() * 3, torch.rand(shapes[0], generator=g)],
        [torch.rand(shapes[1], generator=g).bfloat16(), None],
    ]
    lams = [2.0, 0.5]
    work = [p.to(CUDA, copy=True) for p in params]
    proximal_pull_(
        work,
        [t.to(CUDA) for t in theta0],
        [[f.to(CUDA) if f is not None else None for f in row] for row in fishers],
        lams,
        chunk=1000,
    )
    for got, p, t0, row in zip(work, params, theta0, fishers, strict=True):
        strength = sum(lam * f.double() for lam, f in zip(lams, row, strict=True) if f is not None)
        want = t0.double() + (p.double() - t0.double()) / (1 + strength)
        assert got.device.type == "cuda" and got.dtype == torch.bfloat16
        assert_one_bf16_rounding(got, want, p.double(), t0.double())
        assert float((got.double().cpu() - p.double()).abs().max()) > 0.1  # the pull moved it


@pytest.mark.parametrize("plan_name", PLANS)
def test_cfpstate_correct_on_cuda_bf16_against_float64(plan_name):
    """CFPState.correct(lam) on a bf16 model on CUDA, for each memory plan: every element is theta0 + (p - theta0)
    / (1 + lam F) in float64 within one bf16 rounding, F as the plan stores it (bf16 for fisher_dtype="bfloat16";
    for sparse, F above the top-1% threshold and 0 elsewhere, where the proposal is kept bit for bit). theta0 is
    kept where the plan says: beside the parameter in bf16, or (sparse) in pinned CPU memory, with the kept
    coordinates on the GPU."""
    plan = PLANS[plan_name]
    model, anchor, state, theta0 = bound_state(plan)
    train_a_little(model)
    proposal = {n: p.detach().double().cpu() for n, p in model.named_parameters()}
    state.correct(LAM)
    fisher = applied_fisher(anchor.fisher, plan)
    moved = 0
    for name, p in model.named_parameters():
        want = theta0[name] + (proposal[name] - theta0[name]) / (1 + LAM * fisher[name])
        assert p.device.type == "cuda" and p.dtype == torch.bfloat16
        assert_one_bf16_rounding(p.detach(), want, proposal[name], theta0[name])
        uncorrected = fisher[name] == 0
        assert torch.equal(p.detach().double().cpu()[uncorrected], proposal[name][uncorrected])
        moved += int((p.detach().double().cpu() != proposal[name]).sum())
    assert moved > 0
    assert all(t.dtype == torch.bfloat16 for t in state.theta0)
    if plan.sparse is None:
        assert all(t.device.type == "cuda" for t in state.theta0)
    else:
        assert all(t.device.type == "cpu" and t.is_pinned() for t in state.theta0)
        assert state.sparse is not None and all(t.device.type == "cuda" for t in state.sparse.theta0)
        assert 0 < state.sparse_report.kept <= math.ceil(0.01 * state.sparse_report.covered)


@pytest.mark.parametrize("plan_name", PLANS)
def test_drift_metrics_on_cuda_against_float64_loop(plan_name):
    """CFPState.drift_metrics() after a correction on CUDA equals the float64 CPU loop `drift_reference` over
    the full theta0 and F (sparse: read from pinned CPU memory, so exact over every coordinate, not only the
    corrected ones): sensitive drift and predicted KL with F as stored, free drift over the coordinates whose
    stored F is at most the threshold of the anchor's float32 F (compared in float32), total drift."""
    plan = PLANS[plan_name]
    model, anchor, state, theta0 = bound_state(plan)
    train_a_little(model)
    state.correct(LAM)
    deltas = {n: p.detach().double().cpu() - theta0[n] for n, p in model.named_parameters()}
    stored = {n: f.to(getattr(torch, plan.fisher_dtype)) for n, f in anchor.fisher.items()}
    reference = drift_reference(deltas, stored, "math")
    # free drift: ||Delta|| where the stored F (widened to float32) <= t, t the ceil(0.99 n)-th smallest of the
    # anchor's float32 F, fixed once from the anchor (not rounded to the stored dtype: a bf16 F that rounds up
    # past t is not free)
    values = torch.cat([f.reshape(-1) for f in anchor.fisher.values()])
    threshold = values.sort().values[math.ceil(0.99 * values.numel()) - 1]
    free_sq = sum(float(d[stored[n].float() <= threshold].square().sum()) for n, d in deltas.items())
    reference["cfp/math/free_drift"] = math.sqrt(free_sq)
    assert_metrics_match(state.drift_metrics(), reference, rel=1e-6)


def test_estimate_fisher_on_cuda_batched_matches_loop_and_cpu(monkeypatch):
    """estimate_fisher on a tiny Llama on CUDA. float32: the batched engine equals the loop engine (the exact
    per-sequence reference) as on the CPU (rtol 1e-5), and the CPU's anchor on the same tokens within rtol 1e-4
    (float32 kernels that sum in another order). generate draws on the model's device, from its random state, so
    the CPU would draw other tokens: the CPU run is given the CUDA run's draws (`SamplingSettings.draw` replayed),
    while the loop engine on CUDA draws them again from the same seed.
    bf16: batched and loop within 2^-5 in relative L2 per tensor (each score goes through a bf16 forward and
    backward, a few 2^-8 roundings, then is squared; 0.3% measured on the CPU's bf16 kernels)."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # float32 means float32 here
    prompts = [[1, 2, 3, 4], [6], [7, 8]]
    options = dict(num_sequences=12, max_new_tokens=6, batch_size=4, seed=1, show_progress=False)

    def llama():
        return tiny_llama(vocab_size=24, seed=3, eos_token_id=5)

    draw, drawn = SamplingSettings.draw, {}

    def recording(settings, model, batch, k, on_step=None):
        drawn[k] = draw(settings, model, batch, k, on_step)
        return drawn[k]

    model = llama().to(CUDA)
    cuda_random_state = torch.cuda.get_rng_state(CUDA)
    with monkeypatch.context() as patch:
        patch.setattr(SamplingSettings, "draw", recording)
        batched = estimate_fisher(model, None, prompts, engine="batched", **options)
        patch.setattr(SamplingSettings, "draw", lambda settings, model, batch, k, on_step=None: drawn[k])
        cpu = estimate_fisher(llama(), None, prompts, engine="batched", **options)
    loop = estimate_fisher(model, None, prompts, engine="loop", **options)
    assert torch.equal(torch.cuda.get_rng_state(CUDA), cuda_random_state)  # generate drew from a forked state
    assert batched.metadata["mean_response_tokens"] == loop.metadata["mean_response_tokens"]
    assert batched.metadata["mean_response_tokens"] == cpu.metadata["mean_response_tokens"]
    for name, want in loop.fisher.items():
        assert want.device.type == "cpu" and batched.fisher[name].dtype == torch.float32
        assert float(want.max()) > 0, name
        torch.testing.assert_close(batched.fisher[name], want, rtol=1e-5, atol=1e-6 * float(want.max()), msg=name)
        torch.testing.assert_close(cpu.fisher[name], want, rtol=1e-4, atol=1e-5 * float(want.max()), msg=name)

    model_bf16 = llama().to(CUDA, torch.bfloat16)
    batched = estimate_fisher(model_bf16, None, prompts, engine="batched", **options)
    loop = estimate_fisher(model_bf16, None, prompts, engine="loop", **options)
    for name, want in loop.fisher.items():
        assert float(want.norm()) > 0, name
        assert float((batched.fisher[name] - want).norm() / want.norm()) <= 2**-5, name


@pytest.mark.parametrize("sparse", [None, 0.01], ids=["dense", "sparse"])
def test_trainer_bf16_on_cuda_against_reference(tmp_path, sparse):
    """A 4-step Trainer run (AdamW, bf16=True) of a bf16 tiny Llama on CUDA with CFPCallback(lam=3): every step's
    correction is the float64 formula on that step's proposal within one bf16 rounding (`StepReference`, F zero
    where the sparse plan corrects not), and the logged cfp metrics equal the float64 drift of the final
    weights (`drift_reference`, full F: the sparse plan's metrics are exact)."""
    if not torch.cuda.is_bf16_supported():
        pytest.skip("TrainingArguments(bf16=True) needs a GPU with bf16 support (Ampere or newer)")
    base = tiny_llama().to(CUDA, torch.bfloat16)
    anchor = random_anchor(base)
    fisher = kept_fisher(anchor.fisher, sparse) if sparse is not None else anchor.fisher
    check = StepReference(fisher, 3.0)
    callback = CFPCallback(anchor, lam=3.0, sparse=sparse)
    model = copy.deepcopy(base)
    trainer = short_run(model, tmp_path, [callback, check], steps=4, use_cpu=False, bf16=True)
    assert all(p.device.type == "cuda" and p.dtype == torch.bfloat16 for p in model.parameters())
    assert check.steps == 4
    assert check.violations == 0, f"largest gap {check.largest_gap_over_bound:.2f} x the bf16 bound"
    assert check.exact >= 0.9 * check.checked  # float32 compute rounded once, not bf16 arithmetic
    logs = last_cfp_logs(trainer)
    assert logs["cfp/math/lam"] == 3.0
    deltas = {n: p.detach().double().cpu() - check.theta0[n] for n, p in model.named_parameters()}
    assert_metrics_match(logs, drift_reference(deltas, anchor.fisher, "math"), rel=1e-5)


def test_fused_kernels_on_cuda_match_float64():
    """Tensors large enough for the fused kernels (Triton on a GPU): the pull within one bf16 rounding, the drift
    and budget sums within 1e-6 of float64 loops."""
    from hf_cfp.ops import DriftView, budget_terms, drift_squares, fused

    g = torch.Generator().manual_seed(0)
    n = fused.MIN_ELEMENTS * 3 + 7
    theta0 = torch.randn(n, generator=g).bfloat16()
    proposal = (theta0.float() + torch.randn(n, generator=g)).bfloat16()
    fisher = torch.rand(n, generator=g) * 3
    param = proposal.to(CUDA, copy=True)
    proximal_pull_([param], [theta0.to(CUDA)], [[fisher.to(CUDA)]], [LAM])
    assert fused.available(), "the kernels fell back to the pack path on this GPU (see the logged warning)"
    want = theta0.double() + (proposal.double() - theta0.double()) / (1 + LAM * fisher.double())
    assert_one_bf16_rounding(param, want, proposal.double(), theta0.double())
    delta, f = proposal.double() - theta0.double(), fisher.double()
    sums = drift_squares([proposal.to(CUDA)], [theta0.to(CUDA)], [DriftView([fisher.to(CUDA)], 1.5)])
    reference = [delta.square().sum(), (f * delta.square()).sum(), delta.square()[f <= 1.5].sum()]
    assert torch.allclose(sums, torch.stack(reference), rtol=1e-6)
    terms = budget_terms([proposal.to(CUDA)], [theta0.to(CUDA)], [[fisher.to(CUDA)]], [LAM])
    relief = 1 + LAM * f
    want_terms = torch.stack(
        [(0.5 * f * (delta / relief).square()).sum(), -(f.square() * delta.square() / relief**3).sum()]
    )
    assert torch.allclose(terms[:, 0], want_terms, rtol=1e-6)


def test_kfac_correction_on_cuda_is_the_dense_solve():
    """A K-FAC anchor (estimated on the CPU) protecting a float32 model on CUDA: every factored weight's correction
    is (I + lam kron(G, A))^-1 vec(D) in float64, the diagonal parameters follow the diagonal formula."""
    model = tiny_llama(vocab_size=40, hidden_size=16, layers=1, seed=5)
    anchor = estimate_fisher(
        model,
        None,
        [[1, 2, 3], [4, 5, 6]],
        num_sequences=6,
        max_new_tokens=4,
        structure="kfac",
        show_progress=False,
        name="math",
    )
    theta0 = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    model.to(CUDA)
    state = CFPState(model, anchor)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g).to(CUDA))
    proposal = {n: p.detach().double().cpu() for n, p in model.named_parameters()}
    state.correct(30.0)
    params = {n: p.detach().double().cpu() for n, p in model.named_parameters()}
    for name in anchor.kfac_names:
        a, gg = anchor.kfac_factors(name)
        d = (proposal[name] - theta0[name]).reshape(-1)
        kernel = torch.kron(gg.double(), a.double())
        want = theta0[name].reshape(-1) + torch.linalg.solve(torch.eye(len(d), dtype=torch.float64) + 30.0 * kernel, d)
        assert torch.allclose(params[name].reshape(-1), want, atol=1e-5), name
    # the pull moved the factored weights (q and k barely: their G is ~1e-6 at a random init; v, o, lm_head a lot)
    assert max(float((params[n] - proposal[n]).abs().max()) for n in anchor.kfac_names) > 1e-2
    for name, fisher in anchor.fisher.items():
        want = theta0[name] + (proposal[name] - theta0[name]) / (1 + 30.0 * fisher.double())
        assert torch.allclose(params[name], want, atol=1e-6), name
