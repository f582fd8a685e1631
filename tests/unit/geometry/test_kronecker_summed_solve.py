"""The summed proximal map of several anchors on one weight (`geometry.kronecker.summed_solve`) against a dense
float64 solve of (I + sum_k lam_k kron(G_k, A_k) + diag(sum_j lam_j F_j)) vec(X) = vec(D) (row-major vec), for
full-rank and truncated-with-tails bases, with and without a diagonal term; split into row shards it gives the same
X."""

import threading

import pytest
import torch

from hf_cfp.geometry.kronecker.artifact import dense_factors, truncate_basis
from hf_cfp.geometry.kronecker.basis import KroneckerBasis
from hf_cfp.geometry.kronecker.pooled import pooled_term
from hf_cfp.geometry.kronecker.summed_solve import TOLERANCE, SummedPenalty, closed_form, solve_summed

OUT, IN = 6, 9


def random_basis(seed, rank=None):
    g = torch.Generator().manual_seed(seed)

    def factor(n):
        x = torch.randn(n, n + 2, generator=g, dtype=torch.float64)
        values, vectors = torch.linalg.eigh(x @ x.T / n)  # ascending: the top ones first, as anchors keep them
        return vectors.flip(-1).float(), values.flip(-1).clamp(min=0).float()

    (a_vectors, a_values), (g_vectors, g_values) = factor(IN), factor(OUT)
    basis = KroneckerBasis(a_vectors, a_values, g_vectors, g_values)
    return basis if rank is None else truncate_basis(basis, rank)


def dense_system(terms, diagonal=None):
    system = torch.eye(OUT * IN, dtype=torch.float64)
    for basis, lam in terms:
        a, g = dense_factors(basis.placed("cpu", torch.float64))  # formed in float64: float32 products err by ~1e-5
        system += lam * torch.kron(g.double(), a.double())
    if diagonal is not None:
        system += torch.diag(diagonal.double().reshape(-1))
    return system


@pytest.mark.parametrize("rank", [None, 3, 2])  # 2: every block of `summed_blocks` holds directions
@pytest.mark.parametrize("anchors", [2, 3])
@pytest.mark.parametrize("with_diagonal", [False, True])
def test_the_solve_is_the_dense_proximal_map(rank, anchors, with_diagonal):
    terms = [(random_basis(seed, rank), lam) for seed, lam in zip(range(anchors), (3.0, 20.0, 0.5), strict=False)]
    g = torch.Generator().manual_seed(7)
    diagonal = 4.0 * torch.rand(OUT, IN, generator=g, dtype=torch.float64) if with_diagonal else None
    d = torch.randn(OUT, IN, generator=g, dtype=torch.float64)
    system = dense_system(terms, diagonal)
    want = torch.linalg.solve(system, d.reshape(-1)).reshape(OUT, IN)
    penalty = SummedPenalty([(basis.placed("cpu", torch.float64), lam) for basis, lam in terms], diagonal)
    solve = solve_summed(d, penalty)
    assert solve.residual <= TOLERANCE and solve.iterations >= 1
    residual = float((system @ solve.x.reshape(-1) - d.reshape(-1)).norm() / d.norm())
    assert residual == pytest.approx(solve.residual, rel=0.05)  # the reported residual is the whole system's
    # the system is >= I, so |X - X*| <= |residual| <= TOLERANCE |D|
    assert float((solve.x - want).norm()) <= TOLERANCE * float(d.norm())


def test_one_term_is_its_closed_form_in_no_iteration():
    basis = random_basis(1, rank=3)
    d = torch.randn(OUT, IN, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    solve = solve_summed(d, SummedPenalty([(basis.placed("cpu", torch.float64), 5.0)]))
    want = torch.linalg.solve(dense_system([(basis, 5.0)]), d.reshape(-1)).reshape(OUT, IN)
    assert solve.iterations == 0
    assert torch.allclose(solve.x, want, atol=1e-6)
    assert torch.allclose(closed_form(basis.placed("cpu", torch.float64), 5.0, d), want, atol=1e-6)


def test_the_product_is_the_dense_operator():
    terms = [(random_basis(3, rank=2), 2.0), (random_basis(4), 7.0)]
    diagonal = torch.rand(OUT, IN, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    x = torch.randn(OUT, IN, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    penalty = SummedPenalty([(b.placed("cpu", torch.float64), lam) for b, lam in terms], diagonal)
    want = (dense_system(terms, diagonal) @ x.reshape(-1)).reshape(OUT, IN)
    assert torch.allclose(penalty.apply(x), want, atol=1e-6)


@pytest.mark.parametrize("with_diagonal", [False, True])
def test_row_shards_completed_by_a_reduce_give_the_whole_solution(with_diagonal):
    """Two 'processes' holding rows 0:2 and 2:6 of X, U_G (and the diagonal term): each projection's partial sums,
    Gram matrix and dot product are summed across them (a simulated all-reduce), and each recovers its rows of the
    whole solve (K-FAC terms alone: by blocks, each of them holding directions; with a diagonal term: by conjugate
    gradient on the whole weight)."""
    terms = [(random_basis(8, rank=2), 4.0), (random_basis(9, rank=2), 12.0)]
    g = torch.Generator().manual_seed(10)
    d = torch.randn(OUT, IN, generator=g, dtype=torch.float64)
    diagonal = 4.0 * torch.rand(OUT, IN, generator=g, dtype=torch.float64) if with_diagonal else None
    whole = solve_summed(d, SummedPenalty([(b.placed("cpu", torch.float64), lam) for b, lam in terms], diagonal)).x
    splits = [slice(0, 2), slice(2, OUT)]
    shards = [
        [
            (KroneckerBasis(b.a_vectors, b.a_values, b.g_vectors[rows], b.g_values, b.a_tail, b.g_tail), lam)
            for b, lam in terms
        ]
        for rows in splits
    ]
    # run the shards in lockstep: each reduce call gathers both processes' partials
    barrier, partials, results = threading.Barrier(2), [None, None], [None, None]

    def make_reduce(rank):
        def reduce(tensors):
            partials[rank] = [t.clone() for t in tensors]
            barrier.wait()
            for i, t in enumerate(tensors):
                t.copy_(partials[0][i] + partials[1][i])
            barrier.wait()

        return reduce

    def run(rank):
        rows = None if diagonal is None else diagonal[splits[rank]]
        penalty = SummedPenalty([(b.placed("cpu", torch.float64), lam) for b, lam in shards[rank]], rows)
        results[rank] = solve_summed(d[splits[rank]], penalty, make_reduce(rank))

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results[0].iterations == results[1].iterations
    got = torch.cat([results[0].x, results[1].x])  # the same iterations: equal to the sums' rounding
    assert float((got - whole).norm() / whole.norm()) <= TOLERANCE


def rearranged(terms):
    """sum_k lam_k vec(G_k) vec(A_k)^T (OUT^2 x IN^2, float64): Van Loan and Pitsianis's rearrangement."""
    total = torch.zeros(OUT * OUT, IN * IN, dtype=torch.float64)
    for basis, lam in terms:
        a, g = dense_factors(basis.placed("cpu", torch.float64))  # formed in float64: float32 products err by ~1e-5
        total += lam * torch.outer(g.double().reshape(-1), a.double().reshape(-1))
    return total


@pytest.mark.parametrize("rank", [None, 3])
def test_the_pooled_term_is_the_nearest_kronecker_product(rank):
    """s G_p (x) A_p against the top singular pair of the rearranged sum (a dense SVD)."""
    terms = [(random_basis(11, rank), 2.0), (random_basis(12, rank), 9.0)]
    u, sigma, vh = torch.linalg.svd(rearranged(terms))
    want = sigma[0] * torch.kron(u[:, 0].reshape(OUT, OUT), vh[0].reshape(IN, IN))
    basis, s = pooled_term([(b.placed("cpu", torch.float64), lam) for b, lam in terms], lambda tensors: None)
    a, g = dense_factors(basis)
    got = s * torch.kron(g.double(), a.double())
    assert torch.allclose(got, want, atol=1e-5 * float(want.abs().max()))


def test_terms_sharing_their_input_factor_are_solved_by_the_pooled_closed_form():
    """lam_1 G_1 (x) A + lam_2 G_2 (x) A = (lam_1 G_1 + lam_2 G_2) (x) A: the preconditioner is exact, no iteration."""
    shared, other = random_basis(13, rank=3), random_basis(14, rank=3)
    second = KroneckerBasis(
        shared.a_vectors, shared.a_values, other.g_vectors, other.g_values, shared.a_tail, other.g_tail
    )
    terms = [(shared, 4.0), (second, 30.0)]
    d = torch.randn(OUT, IN, generator=torch.Generator().manual_seed(15), dtype=torch.float64)
    solve = solve_summed(d, SummedPenalty([(b.placed("cpu", torch.float64), lam) for b, lam in terms]))
    want = torch.linalg.solve(dense_system(terms), d.reshape(-1)).reshape(OUT, IN)
    assert solve.iterations == 0 and torch.allclose(solve.x, want, atol=1e-6)
