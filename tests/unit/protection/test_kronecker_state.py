"""CFPState with K-FAC anchors against dense float64 references: the correction of every factored weight is the
solve (I + lam kron(G, A))^-1 vec(D) (row-major), every other parameter follows the diagonal formula, the drift
metrics are the quadratic forms and the rotated free sums, the KL budget holds the dense quadratic, and what has no
exact correction is refused."""

import itertools
import math

import pytest
import torch
from support.tiny import tiny_llama
from transformers import GPT2Config, GPT2LMHeadModel

from hf_cfp import FisherAnchor, estimate_fisher
from hf_cfp.errors import CFPArgumentError
from hf_cfp.geometry.kronecker.artifact import truncate_basis
from hf_cfp.geometry.kronecker.state import balanced_owners
from hf_cfp.names import FREE_DRIFT, PREDICTED_KL, SENSITIVE_DRIFT, TOTAL_DRIFT
from hf_cfp.protection import CFPState


def kfac_anchor(model, name="math", rank=None, seed=0):
    return estimate_fisher(
        model,
        None,
        [[1, 2, 3], [4, 5, 6, 7]],
        num_sequences=6,
        max_new_tokens=4,
        batch_size=3,
        seed=seed,
        structure="kfac",
        kfac_rank=rank,
        show_progress=False,
        name=name,
    )


def propose(model, seed=0, scale=0.05):
    """An optimizer proposal: every parameter moved; returns theta0 and the proposal by name (float64)."""
    g = torch.Generator().manual_seed(seed)
    theta0 = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return theta0, {n: p.detach().double().clone() for n, p in model.named_parameters()}


def dense_kernel(anchor, name):
    a, g = anchor.kfac_factors(name)
    return torch.kron(g.double(), a.double())


def weight_view(model, name, tensor):
    """tensor as the K-FAC weight's out x in matrix (Conv1D stores W^T)."""
    module = model.get_submodule(name.rsplit(".", 1)[0])
    return tensor.T if type(module).__name__ == "Conv1D" else tensor


@pytest.mark.parametrize("rank", [None, 3])
def test_correction_is_the_dense_proximal_solve_on_factored_weights_and_diagonal_elsewhere(rank):
    model = tiny_llama(vocab_size=40, hidden_size=16, layers=1, seed=5)
    anchor = kfac_anchor(model, rank=rank)
    state = CFPState(model, anchor)
    theta0, proposal = propose(model)
    lam = 30.0
    state.correct(lam)
    params = dict(model.named_parameters())
    for name in anchor.kfac_names:
        d = (proposal[name] - theta0[name]).reshape(-1)
        kernel = dense_kernel(anchor, name)
        want = theta0[name].reshape(-1) + torch.linalg.solve(torch.eye(len(d), dtype=torch.float64) + lam * kernel, d)
        assert torch.allclose(params[name].double().reshape(-1), want, atol=2e-6), name
    for name, f in anchor.fisher.items():
        want = theta0[name] + (proposal[name] - theta0[name]) / (1 + lam * f.double())
        assert torch.allclose(params[name].double(), want, atol=1e-6), name


def test_gpt2_conv1d_weights_are_corrected_in_their_transposed_orientation():
    config = GPT2Config(vocab_size=40, n_embd=16, n_layer=1, n_head=2, n_positions=32, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config).eval()
    anchor = kfac_anchor(model)
    assert "transformer.h.0.attn.c_attn.weight" in anchor.kfac_names
    a, g = anchor.kfac_factors("transformer.h.0.attn.c_attn.weight")
    assert a.shape == (16, 16) and g.shape == (48, 48)  # c_attn: W^T stored (16, 48), the weight is 48 x 16
    state = CFPState(model, anchor)
    theta0, proposal = propose(model, seed=1)
    state.correct(10.0)
    params = dict(model.named_parameters())
    for name in anchor.kfac_names:
        d = weight_view(model, name, proposal[name] - theta0[name]).reshape(-1)
        solved = torch.linalg.solve(torch.eye(len(d), dtype=torch.float64) + 10.0 * dense_kernel(anchor, name), d)
        got = weight_view(model, name, params[name].double() - theta0[name]).reshape(-1)
        assert torch.allclose(got, solved, atol=2e-6), name


def test_metrics_are_the_dense_quadratic_and_the_rotated_free_sums():
    """sensitive^2 = sum vec(D)^T (G (x) A) vec(D) + sum F D^2; free^2 = the squared rotated coordinates of weight
    <= the threshold (the k-th smallest weight over every coordinate: gamma alpha^T on the kept block, 0 outside a
    truncated block, the diagonal F elsewhere), the left-out ones carrying ||D||^2 - ||block||^2 in all."""
    model = tiny_llama(vocab_size=40, hidden_size=16, layers=1, seed=6)
    full = kfac_anchor(model)
    bases = {name: truncate_basis(basis, 4, tail="zero") for name, basis in full.kfac.items()}
    anchor = FisherAnchor(dict(full.fisher), name="math", metadata=full.metadata, kfac=bases)
    state = CFPState(model, anchor, free_fraction=0.9)
    theta0, now = propose(model, seed=2)
    metrics = state.drift_metrics()
    weights, sensitive, rotated = [], 0.0, []
    for name in anchor.kfac_names:
        delta = (now[name] - theta0[name]).reshape(-1)
        sensitive += float(delta @ dense_kernel(anchor, name) @ delta)
        basis = anchor.kfac[name]
        block = basis.g_vectors.double().T @ (now[name] - theta0[name]) @ basis.a_vectors.double()
        products = torch.outer(basis.g_values, basis.a_values)
        left_out = delta.numel() - products.numel()
        weights += [products.reshape(-1), torch.zeros(left_out)]
        rotated.append((products, block.square(), float(delta.square().sum() - block.square().sum())))
    for name, f in anchor.fisher.items():
        sensitive += float((f.double() * (now[name] - theta0[name]).square()).sum())
        weights.append(f.reshape(-1))
    everything = torch.cat(weights)
    threshold = float(everything.kthvalue(math.ceil(0.9 * len(everything))).values)
    free = sum(float(squares[products <= threshold].sum()) + outside for products, squares, outside in rotated)
    free += sum(float((now[n] - theta0[n]).square()[f <= threshold].sum()) for n, f in anchor.fisher.items())
    total = sum(float((now[n] - theta0[n]).square().sum()) for n in now)
    assert state.views["math"].threshold == threshold
    assert metrics[SENSITIVE_DRIFT.key("math")] == pytest.approx(math.sqrt(sensitive), rel=1e-5)
    assert metrics[PREDICTED_KL.key("math")] == pytest.approx(0.5 * sensitive, rel=1e-5)
    assert metrics[FREE_DRIFT.key("math")] == pytest.approx(math.sqrt(free), rel=1e-4)
    assert metrics[TOTAL_DRIFT.key()] == pytest.approx(math.sqrt(total), rel=1e-6)


def test_metrics_with_tails_are_the_dense_quadratic_and_the_free_sums_in_its_eigenbasis():
    """Rank 3 with the mean tails: sensitive^2 = sum vec(D)^T (G_r (x) A_r) vec(D) + sum F D^2; free^2 = the squared
    coordinates of vec(D) in the full eigenbasis of G_r (x) A_r (dense eigh) whose eigenvalue is <= the threshold,
    the threshold the k-th smallest of all those eigenvalues and the diagonal F."""
    model = tiny_llama(vocab_size=40, hidden_size=16, layers=1, seed=6)
    anchor = kfac_anchor(model, rank=3)
    assert all(basis.tailed for basis in anchor.kfac.values())
    state = CFPState(model, anchor, free_fraction=0.9)
    theta0, now = propose(model, seed=2)
    metrics = state.drift_metrics()
    eigen, sensitive = [], 0.0
    for name in anchor.kfac_names:
        delta = (now[name] - theta0[name]).reshape(-1)
        kernel = dense_kernel(anchor, name)
        sensitive += float(delta @ kernel @ delta)
        values, vectors = torch.linalg.eigh(kernel)
        eigen.append((values.clamp(min=0), (vectors.T @ delta).square()))
    for name, f in anchor.fisher.items():
        sensitive += float((f.double() * (now[name] - theta0[name]).square()).sum())
    everything = torch.cat([v for v, _ in eigen] + [f.double().reshape(-1) for f in anchor.fisher.values()])
    threshold = float(everything.kthvalue(math.ceil(0.9 * len(everything))).values)
    assert state.views["math"].threshold == pytest.approx(threshold, rel=1e-5)
    threshold = state.views["math"].threshold  # the library's float32 value, between two distinct eigenvalues
    free = sum(float(squares[values <= threshold * (1 + 1e-6)].sum()) for values, squares in eigen)
    free += sum(float((now[n] - theta0[n]).square()[f <= threshold].sum()) for n, f in anchor.fisher.items())
    assert metrics[SENSITIVE_DRIFT.key("math")] == pytest.approx(math.sqrt(sensitive), rel=1e-5)
    assert metrics[FREE_DRIFT.key("math")] == pytest.approx(math.sqrt(free), rel=1e-4)


def test_kl_budget_holds_the_dense_quadratic():
    model = tiny_llama(vocab_size=40, hidden_size=16, layers=1, seed=7)
    anchor = kfac_anchor(model)
    state = CFPState(model, anchor)
    theta0, proposal = propose(model, seed=3, scale=0.2)
    (lam,) = state.budget_lams([0.05])
    state.correct([lam])
    params = dict(model.named_parameters())
    kl = 0.0
    for name in anchor.kfac_names:
        delta = (params[name].double() - theta0[name]).reshape(-1)
        kl += 0.5 * float(delta @ dense_kernel(anchor, name) @ delta)
    for name, f in anchor.fisher.items():
        kl += 0.5 * float((f.double() * (params[name].double() - theta0[name]).square()).sum())
    assert lam > 0 and 0.99 * 0.05 * (1 - 1e-3) <= kl <= 0.05 * (1 + 1e-4)


def test_a_diagonal_monitor_and_a_kfac_protector_share_the_model():
    model = tiny_llama(vocab_size=40, hidden_size=16, layers=1, seed=8)
    kfac = kfac_anchor(model, name="math")
    diagonal = estimate_fisher(
        model, None, [[1, 2, 3]], num_sequences=4, max_new_tokens=3, show_progress=False, name="code"
    )
    state = CFPState(model, kfac, monitors=[diagonal])
    theta0, _ = propose(model, seed=4)
    metrics = state.drift_metrics()
    want = sum(
        float((f.double() * (p.detach().double() - theta0[n]).square()).sum())
        for (n, p), f in ((item, diagonal.fisher[item[0]]) for item in model.named_parameters())
    )
    assert metrics[SENSITIVE_DRIFT.key("code")] == pytest.approx(math.sqrt(want), rel=1e-5)


def test_a_sparse_plan_with_a_kfac_protector_is_refused():
    """(A K-FAC protector beside another protecting anchor on its weights is solved exactly: test_summed_anchors.)"""
    model = tiny_llama(vocab_size=40, hidden_size=16, layers=1, seed=9)
    kfac = kfac_anchor(model, name="math")
    from hf_cfp.protection import MemoryPlan

    with pytest.raises(CFPArgumentError, match="sparse"):
        CFPState(model, kfac, memory=MemoryPlan(sparse=0.01))


def test_mismatched_factors_are_an_anchor_mismatch():
    model = tiny_llama(vocab_size=40, hidden_size=16, layers=1, seed=1)
    bigger = tiny_llama(vocab_size=40, hidden_size=24, layers=1, seed=1)
    from hf_cfp.errors import AnchorMismatchError

    with pytest.raises(AnchorMismatchError):
        CFPState(model, kfac_anchor(bigger))


def test_bfloat16_weights_are_rotated_in_bfloat16_within_their_own_rounding():
    """bf16 weights: the bases are kept and multiplied in bf16, several weights of one shape at a time; the result
    differs from the float64 solve by no more than bf16 rounding of the weights (2^-8 relative, with margin)."""
    model = tiny_llama(vocab_size=40, hidden_size=32, layers=2, seed=5)
    anchor = kfac_anchor(model)
    model = model.to(torch.bfloat16)
    state = CFPState(model, anchor)
    assert all(b.basis.a_vectors.dtype == torch.bfloat16 for g in state.kronecker.groups for b in g.batches)
    assert max(len(b.tensors) for g in state.kronecker.groups for b in g.batches) > 1  # batched
    theta0, proposal = propose(model, seed=6)
    state.correct(30.0)
    params = dict(model.named_parameters())
    for name in anchor.kfac_names:
        d = (proposal[name] - theta0[name]).reshape(-1)
        solved = torch.linalg.solve(torch.eye(len(d), dtype=torch.float64) + 30.0 * dense_kernel(anchor, name), d)
        gap = float((params[name].double().reshape(-1) - theta0[name].reshape(-1) - solved).norm())
        assert gap <= 2**-7 * float(proposal[name].norm()), (name, gap)


@pytest.mark.parametrize("costs, processes", [([5, 3, 3, 2, 2, 1], 2), ([7, 7, 6, 2, 1, 1, 1], 3), ([4], 2), ([], 2)])
def test_ddp_owners_balance_the_correction_within_the_greedy_bound(costs, processes):
    """Every item has one owner in range; the heaviest process carries at most 4/3 of the best split's load
    (largest-first greedy, Graham's bound), the best split found by enumerating every assignment."""
    owners = balanced_owners(costs, processes)
    assert len(owners) == len(costs) and all(0 <= o < processes for o in owners)
    loads = [sum(c for c, o in zip(costs, owners, strict=True) if o == p) for p in range(processes)]
    best = min(
        (
            max(sum(c for c, o in zip(costs, split, strict=True) if o == p) for p in range(processes))
            for split in itertools.product(range(processes), repeat=len(costs))
        ),
        default=0,
    )
    assert max(loads) <= 4 / 3 * best + 1e-9
    assert owners == balanced_owners(costs, processes)  # the same on every process
