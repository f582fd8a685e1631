"""The K-FAC correction and drift (`geometry.kronecker.basis`) against dense float64 references on row-major
vec(Delta)."""

from dataclasses import replace

import pytest
import torch

from hf_cfp.geometry.kronecker.basis import KroneckerBasis, rotated_displacements
from hf_cfp.geometry.kronecker.proximal import kfac_budget_terms, kfac_drift_squares, kfac_pull_


def random_psd(n: int, generator: torch.Generator, rank: int | None = None) -> torch.Tensor:
    """A random symmetric PSD n x n matrix (of the given rank), float64, with a spread of eigenvalues."""
    x = torch.randn(n, rank or n, generator=generator, dtype=torch.float64)
    return x @ x.T / n


def basis_of(a: torch.Tensor, g: torch.Tensor, rank_a: int | None = None, rank_g: int | None = None):
    """The eigenbases of A and G (top `rank` eigenpairs), float32, as an anchor stores them."""
    alpha, qa = torch.linalg.eigh(a)
    gamma, qg = torch.linalg.eigh(g)
    ka, kg = rank_a or len(alpha), rank_g or len(gamma)
    return KroneckerBasis(qa[:, -ka:].float(), alpha[-ka:].float(), qg[:, -kg:].float(), gamma[-kg:].float())


def truncated(m: torch.Tensor, rank: int | None) -> torch.Tensor:
    """m restricted to its top `rank` eigenpairs (float64)."""
    values, vectors = torch.linalg.eigh(m)
    k = rank or len(values)
    return vectors[:, -k:] @ torch.diag(values[-k:]) @ vectors[:, -k:].T


@pytest.mark.parametrize("ranks", [(None, None), (3, 2), (5, None)])
def test_pull_is_the_dense_proximal_solve(ranks):
    """Delta = (I + lam kron(G_r, A_r))^-1 vec_r(D) with the (truncated) factors, D = theta' - theta0."""
    g = torch.Generator().manual_seed(0)
    out_dim, in_dim, lam = 4, 6, 3.0
    a, gg = random_psd(in_dim, g), random_psd(out_dim, g)
    rank_a, rank_g = ranks
    basis = basis_of(a, gg, rank_a, rank_g)
    theta0 = torch.randn(out_dim, in_dim, generator=g)
    proposal = theta0 + torch.randn(out_dim, in_dim, generator=g)
    kernel = torch.kron(truncated(gg, rank_g), truncated(a, rank_a))  # row-major vec: vec(G X A) = (G (x) A) vec X
    expected = theta0.double().reshape(-1) + torch.linalg.solve(
        torch.eye(out_dim * in_dim, dtype=torch.float64) + lam * kernel, (proposal - theta0).double().reshape(-1)
    )
    param = proposal.clone()
    kfac_pull_([param], [theta0], [basis], lam)
    assert torch.allclose(param.double().reshape(-1), expected, rtol=0, atol=2e-6)


def test_pull_keeps_the_proposal_outside_the_basis_and_at_lam_zero():
    g = torch.Generator().manual_seed(1)
    a, gg = random_psd(5, g), random_psd(3, g)
    basis = basis_of(a, gg, rank_a=2, rank_g=1)
    theta0 = torch.randn(3, 5, generator=g)
    # a displacement orthogonal to the kept input directions: its rotated block is 0, nothing moves
    direction = torch.randn(3, 5, generator=g)
    direction -= (direction @ basis.a_vectors) @ basis.a_vectors.T
    param = theta0 + direction
    before = param.clone()
    kfac_pull_([param], [theta0], [basis], 100.0)
    assert torch.allclose(param, before, atol=1e-6)
    pulled = param.clone()
    kfac_pull_([param], [theta0], [basis], 0.0)
    assert torch.equal(param, pulled)


def test_bf16_parameter_rounded_once():
    g = torch.Generator().manual_seed(2)
    a, gg = random_psd(8, g), random_psd(4, g)
    basis = basis_of(a, gg)
    theta0 = torch.randn(4, 8, generator=g).bfloat16()
    param = (theta0.float() + torch.randn(4, 8, generator=g)).bfloat16()
    kernel = torch.kron(gg, a)
    want = theta0.double().reshape(-1) + torch.linalg.solve(
        torch.eye(32, dtype=torch.float64) + 2.0 * kernel, (param.double() - theta0.double()).reshape(-1)
    )
    kfac_pull_([param], [theta0], [basis], 2.0)
    assert param.dtype == torch.bfloat16
    assert torch.allclose(param.double().reshape(-1), want, rtol=2**-7, atol=1e-6)  # one bf16 ulp


@pytest.mark.parametrize("ranks", [(None, None), (3, 2)])
def test_drift_squares_against_dense_quadratic_and_enumerated_free_coordinates(ranks):
    g = torch.Generator().manual_seed(3)
    out_dim, in_dim = 5, 4
    a, gg = random_psd(in_dim, g), random_psd(out_dim, g)
    rank_a, rank_g = ranks
    basis = basis_of(a, gg, rank_a, rank_g)
    theta0 = torch.randn(out_dim, in_dim, generator=g)
    param = theta0 + torch.randn(out_dim, in_dim, generator=g)
    delta = (param - theta0).double()
    a_r, g_r = truncated(a, rank_a), truncated(gg, rank_g)
    sensitive = float(delta.reshape(-1) @ torch.kron(g_r, a_r) @ delta.reshape(-1))
    # every rotated coordinate of the full eigenbases of the truncated factors, with its weight
    alpha, qa = torch.linalg.eigh(a_r)
    gamma, qg = torch.linalg.eigh(g_r)
    squares, weights = (qg.T @ delta @ qa).square(), torch.outer(gamma.clamp(min=0), alpha.clamp(min=0))
    ordered = basis.products().double().reshape(-1).sort().values  # the nonzero weights (the kept block)
    threshold = float(ordered[2] + ordered[3]) / 2  # between two weights: no tie for float32 rounding to break
    free = float(squares[weights <= threshold].sum())
    complete, local = kfac_drift_squares([param - theta0], [basis], threshold)
    assert float(complete[0]) == pytest.approx(sensitive, rel=1e-5)
    assert float(local[0]) == pytest.approx(float(delta.square().sum()), rel=1e-6)
    assert float(complete[1] + local[0]) == pytest.approx(free, rel=1e-5, abs=1e-6)


def test_row_sharded_rotation_and_pull_equal_one_process():
    """Two 'processes' holding rows [0, 3) and [3, 7) of W and of Q_G: the reduce adds their partial rotations, and
    each process's rows after the pull equal those of the one-process pull."""
    g = torch.Generator().manual_seed(4)
    a, gg = random_psd(5, g), random_psd(7, g)
    whole = basis_of(a, gg)
    theta0 = torch.randn(7, 5, generator=g)
    proposal = theta0 + torch.randn(7, 5, generator=g)
    expected = proposal.clone()
    kfac_pull_([expected], [theta0], [whole], 4.0)

    rows = [slice(0, 3), slice(3, 7)]
    shards = [KroneckerBasis(whole.a_vectors, whole.a_values, whole.g_vectors[r], whole.g_values) for r in rows]
    partials = [s.rotate(proposal[r] - theta0[r]) for s, r in zip(shards, rows, strict=True)]
    for rank, (shard, r) in enumerate(zip(shards, rows, strict=True)):

        def reduce(tensors, rank=rank):  # the all-reduce: add the other process's partial sum
            tensors[0].add_(partials[1 - rank])

        assert torch.allclose(
            rotated_displacements([proposal[r]], [theta0[r]], [shard], reduce)[0].kept,
            whole.rotate(proposal - theta0),
            atol=1e-5,
        )
        local = proposal[r].clone()
        kfac_pull_([local], [theta0[r]], [shard], 4.0, reduce=reduce)
        assert torch.allclose(local, expected[r], atol=1e-6)


def test_budget_terms_are_the_corrected_quadratic_and_its_derivative():
    """KL(lam) = 0.5 Delta^T (G (x) A) Delta for Delta the dense proximal solve, and its derivative by central
    differences of that dense reference."""
    g = torch.Generator().manual_seed(5)
    a, gg = random_psd(4, g), random_psd(3, g)
    basis = basis_of(a, gg, rank_a=3)
    theta0 = torch.randn(3, 4, generator=g)
    proposal = theta0 + torch.randn(3, 4, generator=g)
    kernel = torch.kron(gg, truncated(a, 3))
    d = (proposal - theta0).double().reshape(-1)

    assert_budget_terms_are_the_dense_ones(rotated_displacements([proposal], [theta0], [basis]), basis, kernel, d)


def assert_budget_terms_are_the_dense_ones(rotated, basis, kernel, d):
    """KL(lam) = 0.5 Delta^T K Delta for Delta = (I + lam K)^-1 d, and its slope by central differences."""

    def dense_kl(lam):
        delta = torch.linalg.solve(torch.eye(len(d), dtype=torch.float64) + lam * kernel, d)
        return 0.5 * float(delta @ kernel @ delta)

    for lam in (0.0, 0.7, 5.0):
        kl, slope = kfac_budget_terms(rotated, [basis], lam).tolist()
        assert kl == pytest.approx(dense_kl(lam), rel=1e-5)
        step = 1e-4
        assert slope == pytest.approx((dense_kl(lam + step) - dense_kl(lam - step)) / (2 * step), rel=1e-3)


def tailed_basis(a: torch.Tensor, g: torch.Tensor, rank_a: int, rank_g: int, tail: str = "mean"):
    """The top eigenpairs of A and G with the mean of the rest as their tails (float32), and the dense
    A_r = U diag(alpha) U^T + rho (I - U U^T), G_r (float64) it stands for, written out independently."""

    def part(m, rank):
        values, vectors = torch.linalg.eigh(m)
        values, vectors = values.flip(0), vectors.flip(1)
        dim = len(values)
        rho = float(values[rank:].mean()) if tail == "mean" and rank < dim else 0.0
        u = vectors[:, :rank]
        dense = u @ torch.diag(values[:rank]) @ u.T + rho * (torch.eye(dim, dtype=torch.float64) - u @ u.T)
        return u.float(), values[:rank].float(), torch.tensor(rho, dtype=torch.float32), dense

    ua, alpha, rho_a, a_r = part(a, rank_a)
    ug, gamma, rho_g, g_r = part(g, rank_g)
    return KroneckerBasis(ua, alpha, ug, gamma, rho_a, rho_g), a_r, g_r


@pytest.mark.parametrize("ranks", [(2, 3), (1, 1), (6, 2), (3, 4)])  # (6, 2): A full, only G has a tail
def test_pull_with_tails_is_the_dense_proximal_solve(ranks):
    """Delta = (I + lam kron(G_r, A_r))^-1 vec_r(D) for the top-r eigenpairs plus the mean tail of each factor."""
    g = torch.Generator().manual_seed(10)
    out_dim, in_dim, lam = 4, 6, 3.0
    basis, a_r, g_r = tailed_basis(random_psd(in_dim, g), random_psd(out_dim, g), *ranks)
    theta0 = torch.randn(out_dim, in_dim, generator=g)
    proposal = theta0 + torch.randn(out_dim, in_dim, generator=g)
    kernel = torch.kron(g_r, a_r)
    expected = theta0.double().reshape(-1) + torch.linalg.solve(
        torch.eye(out_dim * in_dim, dtype=torch.float64) + lam * kernel, (proposal - theta0).double().reshape(-1)
    )
    param = proposal.clone()
    kfac_pull_([param], [theta0], [basis], lam)
    assert torch.allclose(param.double().reshape(-1), expected, rtol=0, atol=2e-6)
    # the zero tail is the plain truncation: nothing outside the kept block moves
    zero, _, _ = tailed_basis(random_psd(in_dim, g), random_psd(out_dim, g), *ranks, tail="zero")
    direction = torch.randn(out_dim, in_dim, generator=g)
    direction -= (direction @ zero.a_vectors) @ zero.a_vectors.T
    param = theta0 + direction
    kfac_pull_([param], [theta0], [zero], 100.0)
    assert torch.allclose(param, theta0 + direction, atol=1e-6)


def test_drift_and_budget_with_tails_against_the_dense_quadratic_and_enumerated_coordinates():
    """sensitive = vec(D)^T (G_r (x) A_r) vec(D); free = the squared coordinates (in A_r (x) G_r's full eigenbasis)
    whose eigenvalue is <= threshold; KL(lam) and its slope against the dense proximal solve."""
    g = torch.Generator().manual_seed(11)
    out_dim, in_dim = 5, 7
    basis, a_r, g_r = tailed_basis(random_psd(in_dim, g), random_psd(out_dim, g), 3, 2)
    theta0 = torch.randn(out_dim, in_dim, generator=g)
    param = theta0 + torch.randn(out_dim, in_dim, generator=g)
    d = (param - theta0).double()
    kernel = torch.kron(g_r, a_r)
    eigenvalues, vectors = torch.linalg.eigh(kernel)
    squares = (vectors.T @ d.reshape(-1)).square()
    weights = basis.coordinate_weights(out_dim, in_dim).double()
    assert torch.allclose(weights.sort().values, eigenvalues.clamp(min=0).sort().values, rtol=1e-5, atol=1e-7)
    distinct = weights.unique()
    threshold = float(distinct[3] + distinct[4]) / 2
    complete, local = kfac_drift_squares([param - theta0], [basis], threshold)
    assert float(complete[0]) == pytest.approx(float(d.reshape(-1) @ kernel @ d.reshape(-1)), rel=1e-5)
    assert float(complete[1] + local[0]) == pytest.approx(float(squares[eigenvalues <= threshold].sum()), rel=1e-5)

    rotated = rotated_displacements([param], [theta0], [basis])
    assert_budget_terms_are_the_dense_ones(rotated, basis, kernel, d.reshape(-1))


def test_row_sharded_tailed_pull_and_drift_equal_one_process():
    """Rows [0, 3) and [3, 8) on two 'processes': one reduce of the partial P, N and norms gives each process
    its rows of the one-process pull and the one-process drift sums."""
    g = torch.Generator().manual_seed(12)
    whole, _, _ = tailed_basis(random_psd(6, g), random_psd(8, g), 2, 3)
    theta0 = torch.randn(8, 6, generator=g)
    proposal = theta0 + torch.randn(8, 6, generator=g)
    expected = proposal.clone()
    kfac_pull_([expected], [theta0], [whole], 4.0)
    want, _ = kfac_drift_squares([proposal - theta0], [whole], 0.01)
    rows = [slice(0, 3), slice(3, 8)]
    shards = [replace(whole, g_vectors=whole.g_vectors[r]) for r in rows]
    partials = [s.project(proposal[r] - theta0[r]).partials() for s, r in zip(shards, rows, strict=True)]
    for rank, (shard, r) in enumerate(zip(shards, rows, strict=True)):

        def reduce(tensors, rank=rank):  # the all-reduce: add the other process's partial sums
            for mine, theirs in zip(tensors, partials[1 - rank], strict=True):
                mine.add_(theirs)

        local = proposal[r].clone()
        kfac_pull_([local], [theta0[r]], [shard], 4.0, reduce=reduce)
        assert torch.allclose(local, expected[r], atol=1e-6)
        complete, _ = kfac_drift_squares([proposal[r] - theta0[r]], [shard], 0.01, reduce)
        assert torch.allclose(complete, want, rtol=1e-5)


def test_batched_tailed_pull_equals_one_weight_at_a_time():
    g = torch.Generator().manual_seed(13)
    bases = [tailed_basis(random_psd(5, g), random_psd(4, g), 2, 1)[0] for _ in range(3)]
    bases[1] = KroneckerBasis(bases[1].a_vectors, bases[1].a_values, bases[1].g_vectors, bases[1].g_values)
    theta0 = torch.randn(3, 4, 5, generator=g)
    proposal = theta0 + torch.randn(3, 4, 5, generator=g)
    one_by_one = [proposal[i].clone() for i in range(3)]
    for i in range(3):
        kfac_pull_([one_by_one[i]], [theta0[i]], [bases[i]], 2.0)
    stacked = proposal.clone()
    kfac_pull_([stacked], [theta0], [KroneckerBasis.stacked(bases)], 2.0)
    assert torch.allclose(stacked, torch.stack(one_by_one), atol=1e-6)
