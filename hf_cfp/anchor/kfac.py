"""The Kronecker-factored part of an anchor: per Linear-like weight W (out x in), F_W ~ A (x) G kept as the
eigenbases of A (in x in) and G (out x out), stored in the same safetensors files as the diagonal F under the
keys `kfac/<parameter name>/<part>` (parameter names never hold a `/`, so the keys cannot collide).

A factor given dense is checked (square, finite, symmetric, positive semi-definite up to rounding) and
decomposed once, A = Q_A diag(alpha) Q_A^T, keeping the top `rank` eigenpairs; eigenvalues rounded below 0 are
set to 0. A basis read back is checked too (finite, alpha >= 0, orthonormal columns, consistent shapes), so a
corrupt file fails at load, not during training.
"""

from collections.abc import Iterator, Mapping, Sequence

import torch

from ..errors import AnchorValidationError
from ..ops.kfac import KroneckerBasis

KFAC_PREFIX = "kfac/"
PARTS = ("a_vectors", "a_values", "g_vectors", "g_values")
_SYMMETRY_TOLERANCE = 1e-4  # relative to the factor's largest entry
_PSD_TOLERANCE = 1e-5  # the smallest eigenvalue may be this much of the largest below 0 (rounding)
_ORTHONORMAL_TOLERANCE = 1e-3  # max |Q^T Q - I| of a stored float32 (or bfloat16-rounded) basis


def stored_key(name: str, part: str) -> str:
    """The safetensors key of one part of weight `name`'s basis."""
    return f"{KFAC_PREFIX}{name}/{part}"


def is_kfac_key(key: str) -> bool:
    """Whether a stored key belongs to the K-FAC part (else it is a diagonal F)."""
    return key.startswith(KFAC_PREFIX)


def kfac_weight_names(keys: Sequence[str] | Iterator[str]) -> list[str]:
    """The weights whose bases the stored `keys` hold, in order of first appearance."""
    names: dict[str, None] = {}
    for key in keys:
        if is_kfac_key(key):
            names.setdefault(key[len(KFAC_PREFIX) :].rsplit("/", 1)[0], None)
    return list(names)


def basis_from_factors(
    name: str, a: torch.Tensor, g: torch.Tensor, anchor_name: str, rank: int | None = None
) -> KroneckerBasis:
    """The eigenbases of dense factors A (in x in) and G (out x out), float32 on the CPU, each truncated to its top
    `rank` eigenpairs (None: all). Raises AnchorValidationError for a factor that is not a finite symmetric PSD
    square matrix."""
    alpha, q_a = _eigenbasis(name, "A", a, anchor_name, rank)
    gamma, q_g = _eigenbasis(name, "G", g, anchor_name, rank)
    return KroneckerBasis(q_a, alpha, q_g, gamma)


def _eigenbasis(
    name: str, which: str, factor: torch.Tensor, anchor_name: str, rank: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(eigenvalues, eigenvectors) of one factor, largest first, top `rank`, float32."""
    m = torch.as_tensor(factor).detach().to("cpu", torch.float64)
    where = f"Anchor {anchor_name!r}: K-FAC factor {which} of {name!r}"
    if m.dim() != 2 or m.shape[0] != m.shape[1]:
        raise AnchorValidationError(f"{where} has shape {tuple(m.shape)}; a factor is a square matrix.")
    if not torch.isfinite(m).all():
        raise AnchorValidationError(f"{where} holds NaN/Inf values; re-estimate the anchor (in float32).")
    scale = float(m.abs().max()) or 1.0
    if float((m - m.T).abs().max()) > _SYMMETRY_TOLERANCE * scale:
        raise AnchorValidationError(f"{where} is not symmetric; a factor is a second moment, sum x x^T.")
    values, vectors = torch.linalg.eigh((m + m.T) / 2)
    if float(values[0]) < -_PSD_TOLERANCE * max(float(values[-1]), 0.0) - 1e-12:
        raise AnchorValidationError(
            f"{where} is not positive semi-definite (smallest eigenvalue {float(values[0]):.3g}); a factor is a "
            "second moment, sum x x^T: re-estimate the anchor."
        )
    keep = len(values) if rank is None else min(rank, len(values))
    values, vectors = values.flip(0)[:keep].clamp(min=0), vectors.flip(1)[:, :keep]
    return values.float().contiguous(), vectors.float().contiguous()


def check_basis(name: str, basis: KroneckerBasis, anchor_name: str) -> None:
    """Raise AnchorValidationError when a stored basis is not one: shapes that do not fit, NaN/Inf, negative
    eigenvalues, or columns that are not orthonormal."""
    where = f"Anchor {anchor_name!r}: K-FAC basis of {name!r}"
    for which, vectors, values in (("A", basis.a_vectors, basis.a_values), ("G", basis.g_vectors, basis.g_values)):
        if vectors.dim() != 2 or values.dim() != 1 or vectors.shape[1] != values.shape[0]:
            raise AnchorValidationError(
                f"{where}: {which} has eigenvectors of shape {tuple(vectors.shape)} for eigenvalues of shape "
                f"{tuple(values.shape)}; the anchor is corrupt, re-estimate or re-download it."
            )
        if not (torch.isfinite(vectors).all() and torch.isfinite(values).all()):
            raise AnchorValidationError(f"{where}: {which} holds NaN/Inf values; the anchor is corrupt.")
        if (values < 0).any():
            raise AnchorValidationError(
                f"{where}: {which} has negative eigenvalues (min {float(values.min()):.3g}); a factor is positive "
                "semi-definite, the anchor is corrupt."
            )
        gram = vectors.double().T @ vectors.double()
        off = (gram - torch.eye(len(values), dtype=torch.float64)).abs()
        if off.numel() and float(off.max()) > _ORTHONORMAL_TOLERANCE:
            raise AnchorValidationError(f"{where}: {which}'s eigenvectors are not orthonormal; the anchor is corrupt.")


def dense_factors(basis: KroneckerBasis) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, G) = (Q_A diag(alpha) Q_A^T, Q_G diag(gamma) Q_G^T), float32: the factors the basis keeps (rank-r
    matrices when it was truncated)."""
    a = (basis.a_vectors * basis.a_values) @ basis.a_vectors.T
    g = (basis.g_vectors * basis.g_values) @ basis.g_vectors.T
    return a, g


def basis_tensors(bases: Mapping[str, KroneckerBasis]) -> dict[str, torch.Tensor]:
    """The stored tensors of the bases, by key."""
    return {stored_key(name, part): getattr(basis, part) for name, basis in bases.items() for part in PARTS}


def read_bases(stored: Mapping[str, torch.Tensor], anchor_name: str) -> dict[str, KroneckerBasis]:
    """The bases of every K-FAC weight in `stored` (key -> tensor, as read from the files), checked."""
    bases = {}
    for name in kfac_weight_names(iter(stored)):
        missing = [part for part in PARTS if stored_key(name, part) not in stored]
        if missing:
            raise AnchorValidationError(
                f"Anchor {anchor_name!r}: the K-FAC basis of {name!r} lacks {missing}; the anchor is corrupt."
            )
        basis = KroneckerBasis(*(stored[stored_key(name, part)].float().contiguous() for part in PARTS))
        check_basis(name, basis, anchor_name)
        bases[name] = basis
    return bases


class RotatedWeights(Sequence[torch.Tensor]):
    """The quadratic's weights of every rotated coordinate of the K-FAC weights, a tensor per weight computed when
    read (so a streaming pass, `ops.order_statistics`, never holds them all): gamma alpha^T on the kept block,
    then the zeros of the coordinates a truncated basis leaves out (out x in - r_G r_A of them)."""

    def __init__(self, bases: Sequence[KroneckerBasis], numels: Sequence[int]):
        self.bases, self.numels = bases, numels

    def __len__(self) -> int:
        return len(self.bases)

    def __getitem__(self, i):  # an integer index
        products = self.bases[i].products().reshape(-1)
        left_out = self.numels[i] - products.numel()
        return torch.cat([products, products.new_zeros(left_out)]) if left_out else products
