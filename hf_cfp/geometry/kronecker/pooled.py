"""The nearest Kronecker product of a sum of K-FAC terms: the preconditioner of the summed proximal map.

For terms lam_k G_k (x) A_k (`basis`: each factor its kept eigenpairs and a tail, X_r = rho I + U diag(v - rho)
U^T), the Kronecker product s G_p (x) A_p nearest in the Frobenius norm (Van Loan and Pitsianis) has
G_p = sum_k c_k G_k and A_p = sum_k d_k A_k: rearranged, sum_k lam_k vec(G_k) vec(A_k)^T is a rank-K matrix,
and its top singular pair lies in the span of the vec(G_k) and of the vec(A_k). With the Gram matrices of the
factors, H_G[i, j] = <G_i, G_j>_F and H_A likewise (K x K, entries >= 0 for PSD factors), c is the top
eigenvector of diag(lam) H_A diag(lam) H_G (positive: Perron), d = diag(lam) H_G c, and

    s = sum_k lam_k (H_G c)_k (H_A d)_k / ((c^T H_G c) (d^T H_A d)),

then c and d scaled to unit sums (s by the inverse): G_p and A_p depend on the ratios of the lams only, and s is
proportional to them (`SummedTensors` reuses the basis while the ratios stay).

G_p is rho_p I plus a low-rank part W B W^T, W = [U_1, ..., U_K] (n x sum r_k), B = diag(c_k (v_k - rho_k)),
rho_p = sum_k c_k rho_k. Its eigenpairs come from the Gram matrix S = W^T W (an all-reduce when W's rows are
sharded): with S = V diag(sigma) V^T (directions with sigma below 1e-10 max dropped), Q = W V sigma^-1/2 is an
orthonormal basis of the span, Q^T G_p Q - rho_p I = sigma^-1/2 V^T S B S V sigma^-1/2 = Y diag(mu) Y^T, and
G_p = Q Y diag(mu + rho_p) (Q Y)^T + rho_p (I - Q Q^T): a `KroneckerBasis` of rank m <= sum r_k with tail rho_p,
whose closed form (`proximal.shrink_factors`) inverts I + s G_p (x) A_p exactly. When every term is the same
anchor's scaled, it is that term; when the A_k agree (or the G_k), it is the sum itself.
"""

import torch

from .basis import KroneckerBasis, Reduce


def _side(
    parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], dim: int, reduce: Reduce | None
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(S = W^T W, the Gram matrix H of the factors, [v_k - rho_k]) of one side, float64, from each factor's
    (vectors, values, tail); `reduce` completes the row sums of W's rows held here (None: W is whole)."""
    w = torch.cat([vectors.double() for vectors, _, _ in parts], dim=-1)
    gram = w.T @ w
    if reduce is not None:
        reduce([gram])
    spread = [values.double() - tail.double() for _, values, tail in parts]
    tails = [float(tail) for _, _, tail in parts]
    sizes = [len(v) for v in spread]
    blocks = gram.split(sizes, 0)
    inner = torch.zeros(len(parts), len(parts), dtype=torch.float64)
    for i, (row, spread_i, tail_i) in enumerate(zip(blocks, spread, tails, strict=True)):
        for j, (block, spread_j, tail_j) in enumerate(zip(row.split(sizes, 1), spread, tails, strict=True)):
            inner[i, j] = (
                dim * tail_i * tail_j
                + tail_i * spread_j.sum()
                + tail_j * spread_i.sum()
                + (spread_i[:, None] * block.square() * spread_j[None, :]).sum()
            )
    return gram, inner, spread


def _factor(
    vectors: torch.Tensor, gram: torch.Tensor, spread: list[torch.Tensor], tails: list[float], weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(eigenvectors (rows x m), eigenvalues, tail) of sum_k weights_k X_k on one side (module docstring)."""
    sigma, v = torch.linalg.eigh(gram)
    keep = sigma > 1e-10 * sigma.max()
    t = v[:, keep] / sigma[keep].sqrt()
    scaled = torch.cat([weight * s for weight, s in zip(weights.tolist(), spread, strict=True)])
    mu, y = torch.linalg.eigh(t.T @ (gram * scaled) @ gram @ t)
    tail = float(sum(weight * tail for weight, tail in zip(weights.tolist(), tails, strict=True)))
    return (vectors.double() @ (t @ y)), (mu + tail).clamp(min=0), tail


def nearest_mixture(
    h_g: torch.Tensor, h_a: torch.Tensor, lams: list[float]
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(c, d, s) of the Kronecker product s (sum_k c_k G_k) (x) (sum_k d_k A_k) nearest sum_k lam_k G_k (x) A_k, from
    the factors' Gram matrices H_G, H_A (K x K, float64; module docstring), c and d scaled to unit sums."""
    lam = torch.tensor(lams, dtype=torch.float64)
    values, vectors = torch.linalg.eig((lam[:, None] * h_a * lam[None, :]) @ h_g)
    c = vectors[:, values.real.argmax()].real
    c = c * c.sign().sum().sign()  # the Perron vector, positive
    d = lam * (h_g @ c)
    s = float((lam * (h_g @ c) * (h_a @ d)).sum() / ((c @ h_g @ c) * (d @ h_a @ d)))
    return c / c.sum(), d / d.sum(), s * float(c.sum() * d.sum())  # G_p, A_p: unit-sum mixtures; s carries lam


def pooled_term(terms: list[tuple[KroneckerBasis, float]], reduce: Reduce) -> tuple[KroneckerBasis, float]:
    """(basis of G_p (x) A_p, s): the Kronecker product nearest sum_k lam_k G_k,r (x) A_k,r (module docstring), in
    the terms' vectors dtype; `reduce` completes sums over the rows of U_G held here."""
    dtype = terms[0][0].a_vectors.dtype
    a_parts = [(b.a_vectors, b.a_values, b.tails()[0]) for b, _ in terms]
    g_parts = [(b.g_vectors, b.g_values, b.tails()[1]) for b, _ in terms]
    in_dim, out_dim = terms[0][0].a_vectors.shape[-2], _rows(terms, reduce)
    a_gram, h_a, a_spread = _side(a_parts, in_dim, None)
    g_gram, h_g, g_spread = _side(g_parts, out_dim, reduce)
    c, d, s = nearest_mixture(h_g, h_a, [lam for _, lam in terms])
    a_tails, g_tails = [float(t) for _, _, t in a_parts], [float(t) for _, _, t in g_parts]
    a_vectors, a_values, a_tail = _factor(torch.cat([p[0] for p in a_parts], -1), a_gram, a_spread, a_tails, d)
    g_vectors, g_values, g_tail = _factor(torch.cat([p[0] for p in g_parts], -1), g_gram, g_spread, g_tails, c)
    tailed = any(b.tailed for b, _ in terms)
    basis = KroneckerBasis(
        a_vectors.to(dtype),
        a_values.float(),
        g_vectors.to(dtype),
        g_values.float(),
        torch.tensor(a_tail) if tailed else None,
        torch.tensor(g_tail) if tailed else None,
    )
    return basis, s


def _rows(terms: list[tuple[KroneckerBasis, float]], reduce: Reduce) -> int:
    """The number of rows of the whole weight (U_G's rows, summed over the processes holding them)."""
    vectors = terms[0][0].g_vectors
    rows = torch.tensor([float(vectors.shape[-2])], dtype=torch.float64, device=vectors.device)
    reduce([rows])
    return int(rows)
