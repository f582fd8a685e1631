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
from ..names import canonical_name
from ..ops.kfac import KroneckerBasis
from .storage import StoredTensor, read_stored

KFAC_PREFIX = "kfac/"
PARTS = ("a_vectors", "a_values", "g_vectors", "g_values")
_SYMMETRY_TOLERANCE = 1e-4  # relative to the factor's largest entry
_PSD_TOLERANCE = 1e-5  # the smallest eigenvalue may be this much of the largest below 0 (rounding)
_ORTHONORMAL_TOLERANCE = 2e-2  # max |Q^T Q - I|: float32 bases about 1e-7, bfloat16-saved ones up to 5e-3 (n = 8)


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
    alpha, q_a = eigenbasis(name, "A", a, anchor_name, rank)
    gamma, q_g = eigenbasis(name, "G", g, anchor_name, rank)
    return KroneckerBasis(q_a, alpha, q_g, gamma)


def eigenbasis(
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


def kronecker_bases(given, anchor_name: str) -> Mapping[str, KroneckerBasis]:
    """An anchor's K-FAC part from what a user or a loader gives: a `LazyBases` (kept: checked as read), or a
    mapping of weight names to a `KroneckerBasis` (checked) or to dense factors `(A, G)` (checked and decomposed,
    `basis_from_factors`); names are made canonical, tensors float32 on the CPU. None gives no K-FAC part."""
    if given is None:
        return {}
    if isinstance(given, LazyBases):
        return given
    bases = {}
    for key, value in given.items():
        name = canonical_name(key)
        if isinstance(value, KroneckerBasis):
            basis = KroneckerBasis(
                *(getattr(value, part).detach().to("cpu", torch.float32).contiguous() for part in PARTS)
            )
            check_basis(name, basis, anchor_name)
        else:
            a, g = value
            basis = basis_from_factors(name, a, g, anchor_name)
        bases[name] = basis
    return bases


class LazyBases(Mapping[str, KroneckerBasis]):
    """weight name -> its K-FAC basis, read from the anchor's files at each access and checked (`check_basis`);
    `rows` reads only some rows of Q_G (a process holding rows of the weight, FSDP2)."""

    def __init__(self, stored: Mapping[str, StoredTensor], anchor_name: str):
        self._stored, self.anchor_name = stored, anchor_name
        self._names = kfac_weight_names(iter(stored))

    def __getitem__(self, name: str) -> KroneckerBasis:
        return self.rows(name, None)

    def rows(self, name: str, rows: slice | None) -> KroneckerBasis:
        """The basis of `name` with Q_G's rows `rows` only (None: all)."""
        if name not in self._names:
            raise KeyError(name)
        parts = []
        for part in PARTS:
            key = stored_key(name, part)
            if key not in self._stored:
                raise AnchorValidationError(
                    f"Anchor {self.anchor_name!r}: the K-FAC basis of {name!r} lacks {part!r}; the anchor is corrupt."
                )
            index = (rows,) if part == "g_vectors" and rows is not None else None
            parts.append(read_stored(key, self._stored[key], index))
        basis = KroneckerBasis(*parts)
        if rows is None:
            check_basis(name, basis, self.anchor_name)
        return basis

    def shape(self, name: str) -> tuple[int, int]:
        """(out, in) of the weight, from the headers."""
        return self._stored[stored_key(name, "g_vectors")].shape[0], self._stored[stored_key(name, "a_vectors")].shape[
            0
        ]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def weight_shape(bases: Mapping[str, KroneckerBasis], name: str) -> tuple[int, int]:
    """(out, in) of a K-FAC weight, from the headers when the bases are lazy."""
    if isinstance(bases, LazyBases):
        return bases.shape(name)
    basis = bases[name]
    return basis.g_vectors.shape[0], basis.a_vectors.shape[0]


def split_stored(stored: Mapping, anchor_name: str, lazy: bool) -> tuple[dict, Mapping[str, KroneckerBasis]]:
    """(the diagonal part, the K-FAC bases) of an anchor's stored tensors: read tensors (`read_bases`) or, lazily,
    their `StoredTensor` entries (`LazyBases`)."""
    diagonal = {key: value for key, value in stored.items() if not is_kfac_key(key)}
    kronecker = {key: value for key, value in stored.items() if is_kfac_key(key)}
    if lazy:
        return diagonal, LazyBases(kronecker, anchor_name)
    return diagonal, read_bases(kronecker, anchor_name)


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
    and for a K-FAC weight the products gamma alpha^T of its rotated coordinates then zeros for those a truncated
    basis leaves out (`RotatedWeights`). What the anchor's statistics (scale, p99, concentration) run over."""

    def _kronecker(self, name: str) -> torch.Tensor:
        out_dim, in_dim = weight_shape(self.bases, name)
        return RotatedWeights([self.bases[name]], [out_dim * in_dim])[0]


class ImpliedDiagonal(_PerCoordinate):
    """The diagonal of each K-FAC weight's A (x) G, diag(G) diag(A)^T (out x in), beside the diagonal F of the other
    parameters, computed when read: coordinates two K-FAC anchors share even when their eigenbases differ (what
    `compare` reads)."""

    def _kronecker(self, name: str) -> torch.Tensor:
        basis = self.bases[name]
        diag_a = (basis.a_vectors.square() * basis.a_values).sum(1)
        diag_g = (basis.g_vectors.square() * basis.g_values).sum(1)
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
    """What `hf-cfp inspect` shows of the K-FAC part without reading it: {"weights": how many are factored,
    "ranks": the distinct numbers of eigenpairs kept per factor, "stored_floats": eigenvectors and eigenvalues}."""
    ranks = sorted(
        {int(b.a_values.numel()) for b in bases.values()} | {int(b.g_values.numel()) for b in bases.values()}
    )
    floats = sum(t.numel() for b in bases.values() for t in (b.a_vectors, b.a_values, b.g_vectors, b.g_values))
    return {"weights": len(bases), "ranks": ranks, "stored_floats": floats}
