"""What an anchor's Kronecker part reads as coordinate by coordinate, computed when read (a weight at a time, so a
streaming pass never holds them all): the eigenvalue of every coordinate of A_r (x) G_r (`AnchorWeights`, what the
statistics and the free-drift threshold run over), the diagonal of A_r (x) G_r (`ImpliedDiagonal`, what `compare`
reads), and the summaries `compare` and `inspect` show (`factor_cosines`, `kfac_summary`).
"""

from collections.abc import Iterator, Mapping, Sequence

import torch

from .artifact import dense_factors, stored_parts, weight_shape
from .basis import KroneckerBasis


class RotatedWeights(Sequence[torch.Tensor]):
    """The quadratic's eigenvalue of every coordinate of the K-FAC weights, a tensor per weight computed when read
    (so a streaming pass, `ops.order_statistics`, never holds them all): `KroneckerBasis.coordinate_weights`, the
    kept block's gamma alpha^T then the tail blocks' (or, without a tail, the zeros of the coordinates left out)."""

    def __init__(self, bases: Sequence[KroneckerBasis], shapes: Sequence[tuple[int, int]]):
        self.bases, self.shapes = bases, shapes

    def __len__(self) -> int:
        return len(self.bases)

    def __getitem__(self, i):  # an integer index
        return self.bases[i].coordinate_weights(*self.shapes[i])


class _PerCoordinate(Mapping[str, torch.Tensor]):
    """An anchor's diagonal F by parameter name, beside a tensor per K-FAC weight computed when read
    (`_kronecker`, what each subclass defines)."""

    def __init__(self, fisher: Mapping[str, torch.Tensor], bases: Mapping[str, KroneckerBasis]):
        self.fisher, self.bases = fisher, bases

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._kronecker(name) if name in self.bases else self.fisher[name]

    def _kronecker(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def __iter__(self) -> Iterator[str]:
        yield from self.fisher
        yield from self.bases

    def __len__(self) -> int:
        return len(self.fisher) + len(self.bases)


class AnchorWeights(_PerCoordinate):
    """Every coordinate's weight in an anchor's quadratic, by parameter name, computed when read: the diagonal F,
    and for a K-FAC weight the eigenvalue of each of its coordinates in A_r (x) G_r (`RotatedWeights`). What the
    anchor's statistics (scale, p99, concentration) run over."""

    def _kronecker(self, name: str) -> torch.Tensor:
        return RotatedWeights([self.bases[name]], [weight_shape(self.bases, name)])[0]


class ImpliedDiagonal(_PerCoordinate):
    """The diagonal of each K-FAC weight's A_r (x) G_r, diag(G_r) diag(A_r)^T (out x in), beside the diagonal F of
    the other parameters, computed when read: coordinates two K-FAC anchors share even when their eigenbases differ
    (what `compare` reads). diag(X_r)_i = sum_j U_ij^2 values_j + rho (1 - sum_j U_ij^2)."""

    def _kronecker(self, name: str) -> torch.Tensor:
        basis = self.bases[name]
        rho_a, rho_g = basis.tails()
        diag_a = (basis.a_vectors.square() * (basis.a_values - rho_a)).sum(1) + rho_a
        diag_g = (basis.g_vectors.square() * (basis.g_values - rho_g)).sum(1) + rho_g
        return torch.outer(diag_g, diag_a)


def factor_cosines(a: Mapping[str, KroneckerBasis], b: Mapping[str, KroneckerBasis]) -> dict[str, float]:
    """The mean over the K-FAC weights of <X_a, X_b>_F / (||X_a|| ||X_b||) for the dense factors X = A and X = G:
    1 when two anchors' factors agree up to scale, whatever their eigenbases."""
    sums = {"A": 0.0, "G": 0.0}
    for name in a:
        for which, x, y in zip(("A", "G"), dense_factors(a[name]), dense_factors(b[name]), strict=True):
            x, y = x.double(), y.double()
            norms = float(x.norm() * y.norm())
            sums[which] += float((x * y).sum()) / norms if norms > 0 else 0.0
    return {which: total / max(len(a), 1) for which, total in sums.items()}


def kfac_summary(bases: Mapping[str, KroneckerBasis]) -> dict:
    """What `hf-cfp inspect` shows of the K-FAC part: {"weights": how many are factored, "ranks": the distinct
    numbers of eigenpairs kept per factor, "truncated": how many factors keep fewer than all, "tail_share": the
    share of the truncated factors' trace their tails carry (mean over them; 0 when none), "stored_floats":
    eigenvectors, eigenvalues and tails}."""
    ranks, shares, floats = set(), [], 0
    for b in bases.values():
        for vectors, values, tail in zip((b.a_vectors, b.g_vectors), (b.a_values, b.g_values), b.tails(), strict=True):
            dim, kept = vectors.shape[0], values.numel()
            ranks.add(int(kept))
            if kept < dim:
                rest = float(tail) * (dim - kept)
                shares.append(rest / (rest + float(values.double().sum())) if rest > 0 else 0.0)
        floats += sum(t.numel() for t in stored_parts(b).values())
    share = sum(shares) / len(shares) if shares else 0.0
    return {
        "weights": len(bases),
        "ranks": sorted(ranks),
        "truncated": len(shares),
        "tail_share": share,
        "stored_floats": floats,
    }
