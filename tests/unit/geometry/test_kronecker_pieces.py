"""K-FAC on a weight held as flat pieces cut anywhere (`geometry.kronecker.pieces`): three simulated processes, each
with a piece of the row-major flattened weight (one cut inside a row, one piece empty or a single element), reduce
their partial sums in lockstep and each ends with exactly its elements of the one-process correction, the
one-process drift sums and budget terms (which `test_kronecker_basis` checks against dense float64 solves)."""

import threading

import pytest
import torch
from test_kronecker_basis import basis_of, random_psd, tailed_basis

from hf_cfp.geometry.kronecker.basis import KroneckerBasis, rotated_displacements
from hf_cfp.geometry.kronecker.pieces import PieceRows, piece_drift_squares, project_piece, pull_piece_
from hf_cfp.geometry.kronecker.proximal import kfac_budget_terms, kfac_drift_squares, kfac_pull_

OUT, IN = 7, 5


def lockstep_reduces(count: int):
    """One reduce per simulated process: each call waits for all `count` processes' partial sums and sets every
    process's tensors to their sum (an all-reduce)."""
    barrier, partials = threading.Barrier(count), [None] * count

    def make(rank):
        def reduce(tensors):
            partials[rank] = [t.clone() for t in tensors]
            barrier.wait()
            for i, t in enumerate(tensors):
                t.copy_(sum(p[i] for p in partials))
            barrier.wait()

        return reduce

    return [make(rank) for rank in range(count)]


def run_processes(cuts: list[int], work):
    """work(rank, piece, reduce) on one thread per piece [cuts[k], cuts[k + 1]); returns their results by rank."""
    count = len(cuts) - 1
    reduces, results = lockstep_reduces(count), [None] * count

    def run(rank):
        results[rank] = work(rank, PieceRows(cuts[rank], cuts[rank + 1], IN), reduces[rank])

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def bases():
    g = torch.Generator().manual_seed(30)
    a, gg = random_psd(IN, g), random_psd(OUT, g)
    return {
        "full": basis_of(a, gg),
        "truncated": basis_of(a, gg, 2, 3),
        "tails": tailed_basis(a, gg, 2, 3)[0],
        "g tail only": tailed_basis(a, gg, IN, 4)[0],
    }


def rows_of(basis: KroneckerBasis, piece: PieceRows) -> KroneckerBasis:
    return KroneckerBasis(
        basis.a_vectors, basis.a_values, basis.g_vectors[piece.rows], basis.g_values, basis.a_tail, basis.g_tail
    )


CUTS = [[0, 7, 7, OUT * IN], [0, 12, 13, OUT * IN], [0, 3, 30, OUT * IN], [0, 10, 20, OUT * IN]]


@pytest.mark.parametrize("cuts", CUTS)
@pytest.mark.parametrize("kind", ["full", "truncated", "tails", "g tail only"])
def test_pieces_cut_anywhere_correct_their_elements_as_one_process(cuts, kind):
    basis, lam = bases()[kind], 3.0
    g = torch.Generator().manual_seed(31)
    theta0 = torch.randn(OUT, IN, generator=g)
    proposal = theta0 + torch.randn(OUT, IN, generator=g)
    expected = proposal.clone()
    kfac_pull_([expected], [theta0], [basis], lam)
    flat, flat0 = proposal.reshape(-1), theta0.reshape(-1)

    def work(rank, piece, reduce):
        mine, start = flat[piece.start : piece.stop].clone(), flat0[piece.start : piece.stop]
        local = rows_of(basis, piece)
        projection = project_piece(local, piece.laid_out(mine - start), piece, OUT, reduce)
        pull_piece_(mine, start, local, projection, piece, lam)
        return mine

    got = torch.cat(run_processes(cuts, work))
    assert torch.allclose(got, expected.reshape(-1), rtol=0, atol=1e-6)


@pytest.mark.parametrize("cuts", CUTS)
@pytest.mark.parametrize("kind", ["truncated", "tails"])
def test_pieces_give_the_one_process_drift_sums_and_budget_terms(cuts, kind):
    basis = bases()[kind]
    g = torch.Generator().manual_seed(32)
    theta0 = torch.randn(OUT, IN, generator=g)
    param = theta0 + torch.randn(OUT, IN, generator=g)
    want_complete, want_local = kfac_drift_squares([param - theta0], [basis], 0.05)
    want_budget = kfac_budget_terms(rotated_displacements([param], [theta0], [basis]), [basis], 2.0)
    flat = (param - theta0).reshape(-1)

    def work(rank, piece, reduce):
        local = rows_of(basis, piece)
        delta = piece.laid_out(flat[piece.start : piece.stop])
        sums = piece_drift_squares([delta], [local], [piece], [OUT], 0.05, reduce)
        budget = kfac_budget_terms([project_piece(local, delta, piece, OUT, reduce)], [local], 2.0)
        return sums, budget

    results = run_processes(cuts, work)
    for (complete, _), budget in results:  # complete on every process
        assert torch.allclose(complete, want_complete, rtol=1e-5)
        assert torch.allclose(budget, want_budget, rtol=1e-5)
    assert float(sum(local for (_, local), _ in results)) == pytest.approx(float(want_local), rel=1e-6)


def test_a_piece_lays_out_into_the_rows_it_touches():
    piece = PieceRows(7, 18, 5)  # rows 1..3: from the third element of row 1 to the third of row 3
    assert piece.rows == slice(1, 4)
    flat = torch.arange(7.0, 18.0)
    block = piece.laid_out(flat)
    whole = torch.zeros(20)
    whole[7:18] = flat
    assert torch.equal(block, whole.reshape(4, 5)[1:4])
    back = torch.zeros(11)
    piece.write_back_(back, block * 2)
    assert torch.equal(back, flat * 2)
    assert PieceRows(5, 5, 5).rows == slice(0, 0) and PieceRows(5, 5, 5).laid_out(torch.zeros(0)).shape == (0, 5)
