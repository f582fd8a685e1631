"""scripts/plan_7b.py on Llama-3-8B's shape (meta device, seconds): every Linear weight factored, its RESULT line,
and the correction's FLOPs against a count of the products of `geometry.kronecker.basis`."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "scripts" / "plan_7b.py"


def load_plan():
    spec = importlib.util.spec_from_file_location("plan_7b", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_llama_3_8b_factors_every_linear_weight_and_prints_its_result(capsys):
    plan = load_plan()
    plan.main(["--models", "Llama-3-8B", "--kfac-rank", "64"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1
    result = dict(item.split("=", 1) for item in lines[0].split()[1:])
    assert result["model"] == "Llama-3-8B" and result["kfac_rank"] == "64"
    assert result["linear_weights_diagonal"] == "0"
    assert float(result["fsdp2_gb_per_rank"]) < float(result["full_fsdp2_gb_per_rank"])
    assert float(result["fsdp2_comm_gb_per_rank"]) < float(result["full_fsdp2_comm_gb_per_rank"])
    # flat pieces reduce the whole M besides P and N; ZeRO-3 corrects the fp32 master partitions too: twice FSDP1
    assert float(result["fsdp2_comm_gb_per_rank"]) < float(result["fsdp1_comm_gb_per_rank"])
    assert float(result["zero3_tflop_per_rank"]) == pytest.approx(2 * float(result["fsdp1_tflop_per_rank"]), rel=1e-2)
    assert "two_anchor_fsdp1_gb_per_rank" not in result  # refused on flat pieces
    model = plan.load("Llama-3-8B")
    assert len(model.shapes) == 32 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the untied lm_head
    assert not [n for n in model.diagonal if n.endswith("proj.weight") or n == "lm_head.weight"]


def test_flat_pieces_reduce_p_n_the_whole_m_and_the_squared_norm():
    """Counted from `geometry.kronecker.pieces.project_piece`: float32 P (r_G x r_A), N (r_G x in), M (out x r_A)
    and one float64 |D|^2 with a tail; P alone without one."""
    plan = load_plan()
    w = plan.Weight("w", 5, 7, 2, 3)
    assert w.piece_reduced_bytes() == 4 * (3 * 2 + 3 * 7 + 5 * 2) + 8
    full = plan.Weight("w", 5, 7, 7, 5)
    assert full.piece_reduced_bytes() == 4 * 5 * 7


def test_tailed_flops_count_the_products_of_the_correction():
    plan = load_plan()
    rows, in_dim, out_dim, r = 3, 7, 5, 2
    w = plan.Weight("w", out_dim, in_dim, r, r)
    products = [
        (rows, in_dim, r),  # M = D U_A
        (r, rows, r),  # P = U_G^T M
        (r, rows, in_dim),  # N = U_G^T D
        (r, r, in_dim),  # core U_A^T
        (rows, 2 * r, in_dim),  # [U_G, M'] [N'; U_A^T]
    ]
    assert w.tailed and w.flops(rows) == sum(2 * a * b * c for a, b, c in products)
    full = plan.Weight("w", out_dim, in_dim, in_dim, out_dim)
    assert not full.tailed and full.flops(rows) == 2 * (2 * rows * in_dim * in_dim + 2 * rows * in_dim * out_dim)


@pytest.mark.parametrize("iterations", [5, 20])
def test_the_summed_blocks_flops_are_the_solves_matrix_products(iterations):
    """`block_flops` without its factorizations (20 m^3) and triangular solves (2 m^2 in) against torch's count of
    the matrix products `solve_blocks` runs for two tailed anchors, forced to `iterations` (within 20%: the count is
    an estimate of the order of each product, not a tally)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from hf_cfp.geometry.kronecker.basis import KroneckerBasis, no_reduce
    from hf_cfp.geometry.kronecker.summed_blocks import solve_blocks

    plan, (out_dim, in_dim, r) = load_plan(), (96, 160, 12)
    g = torch.Generator().manual_seed(0)

    def factor(n):
        x = torch.randn(n, n, generator=g, dtype=torch.float64)
        values, vectors = torch.linalg.eigh(x @ x.T / n)
        return vectors.flip(-1)[:, :r], values.flip(-1)[:r]

    def basis():
        (a_vectors, a_values), (g_vectors, g_values) = factor(in_dim), factor(out_dim)
        tail = torch.tensor(0.01, dtype=torch.float64)
        return KroneckerBasis(a_vectors, a_values, g_vectors, g_values, tail, tail)

    d, terms = torch.randn(out_dim, in_dim, generator=g, dtype=torch.float64), [(basis(), 30.0), (basis(), 50.0)]
    with FlopCounterMode(display=False) as counter:
        solve = solve_blocks(d, terms, no_reduce, tolerance=0.0, max_iterations=iterations)
    assert solve.iterations == iterations
    m = 2 * r
    predicted = plan.block_flops(plan.Weight("w", out_dim, in_dim, r, r), out_dim, 2, iterations)
    predicted -= 2 * (20 * m**3 + 2 * m * m * in_dim)
    assert counter.get_total_flops() == pytest.approx(predicted, rel=0.2)
