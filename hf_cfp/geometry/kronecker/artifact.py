"""The Kronecker geometry's part of the anchor artifact: per Linear-like weight W (out x in), F_W ~ A (x) G kept as
the top eigenpairs of A (in x in) and G (out x out) and, for a factor that keeps fewer than all, its tail (the mean
of the eigenvalues left out, `basis`), stored in the same safetensors files as the diagonal F under the keys
`kfac/<parameter name>/<part>` (parameter names never hold a `/`, so the keys cannot collide). The tails are
0-dim tensors `a_tail` / `g_tail`, present for a truncated factor only (an anchor saved before tails existed
reads as a tail of 0).

A factor given dense is checked (square, finite, symmetric, positive semi-definite up to rounding) and
decomposed once, A = U_A diag(alpha) U_A^T, keeping the top `rank` eigenpairs and the tail
rho_A = (tr A - sum alpha) / (in - rank) (`tail="mean"`; "zero" treats the rest as free); eigenvalues rounded
below 0 are set to 0. A basis read back is checked too (finite, alpha >= rho >= 0, orthonormal columns, consistent
shapes), so a corrupt file fails at load, not during training.
"""

from collections.abc import Iterator, Mapping, Sequence

import torch

from ...errors import AnchorValidationError, CFPArgumentError
from ...names import canonical_name
from ..base import Stored
from .basis import KroneckerBasis

KFAC_PREFIX = "kfac/"
PARTS = ("a_vectors", "a_values", "g_vectors", "g_values")
TAIL_PARTS = ("a_tail", "g_tail")  # stored for a truncated factor only
TAILS = ("mean", "zero")  # the tail of a truncated factor: the mean of what was left out, or 0 (free)
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
    name: str, a: torch.Tensor, g: torch.Tensor, anchor_name: str, rank: int | None = None, tail: str = "mean"
) -> KroneckerBasis:
    """The eigenbases of dense factors A (in x in) and G (out x out), float32 on the CPU, each truncated to its top
    `rank` eigenpairs (None: all) with its `tail` ("mean": rho = (tr X - sum of the kept eigenvalues) / (dim -
    rank); "zero": the rest free). Raises AnchorValidationError for a factor that is not a finite symmetric PSD
    square matrix."""
    return with_tails(
        *eigenbasis(name, "A", a, anchor_name, rank, tail), *eigenbasis(name, "G", g, anchor_name, rank, tail)
    )


def with_tails(
    a_values: torch.Tensor,
    a_vectors: torch.Tensor,
    a_tail: torch.Tensor | None,
    g_values: torch.Tensor,
    g_vectors: torch.Tensor,
    g_tail: torch.Tensor | None,
) -> KroneckerBasis:
    """The basis of two factors' (eigenvalues, eigenvectors, tail) as `eigenbasis` gives them; a factor with no
    tail beside one that has one gets a tail of 0. Tails that are all 0 (`tail="zero"`) give a basis without
    tails: the same map, by its cheaper path (`basis`)."""
    if all(t is None or float(t) == 0 for t in (a_tail, g_tail)):
        return KroneckerBasis(a_vectors, a_values, g_vectors, g_values)
    zero = torch.zeros((), dtype=torch.float32)
    return KroneckerBasis(a_vectors, a_values, g_vectors, g_values, _or(a_tail, zero), _or(g_tail, zero))


def _or(tail: torch.Tensor | None, zero: torch.Tensor) -> torch.Tensor:
    return zero if tail is None else tail


def checked_factor(name: str, which: str, factor: torch.Tensor, anchor_name: str) -> torch.Tensor:
    """`factor` as a symmetric float64 matrix on the CPU ((X + X^T) / 2). Raises AnchorValidationError when it is
    not a finite symmetric square matrix (its positive semi-definiteness is `eigenbasis`'s to check)."""
    m = torch.as_tensor(factor).detach().to("cpu", torch.float64)
    where = f"Anchor {anchor_name!r}: K-FAC factor {which} of {name!r}"
    if m.dim() != 2 or m.shape[0] != m.shape[1]:
        raise AnchorValidationError(f"{where} has shape {tuple(m.shape)}; a factor is a square matrix.")
    if not torch.isfinite(m).all():
        raise AnchorValidationError(f"{where} holds NaN/Inf values; re-estimate the anchor (in float32).")
    scale = float(m.abs().max()) or 1.0
    if float((m - m.T).abs().max()) > _SYMMETRY_TOLERANCE * scale:
        raise AnchorValidationError(f"{where} is not symmetric; a factor is a second moment, sum x x^T.")
    return (m + m.T) / 2


def eigenbasis(
    name: str, which: str, factor: torch.Tensor, anchor_name: str, rank: int | None, tail: str = "mean"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(eigenvalues, eigenvectors, tail) of one factor, largest first, top `rank`, float32, from its full
    eigendecomposition; the tail (0-dim) is None when every eigenpair is kept (`truncated_spectrum`). Raises
    AnchorValidationError for a factor that is not a finite symmetric positive semi-definite square matrix."""
    m = checked_factor(name, which, factor, anchor_name)
    values, vectors = torch.linalg.eigh(m)
    if float(values[0]) < -_PSD_TOLERANCE * max(float(values[-1]), 0.0) - 1e-12:
        raise AnchorValidationError(
            f"Anchor {anchor_name!r}: K-FAC factor {which} of {name!r} is not positive semi-definite (smallest "
            f"eigenvalue {float(values[0]):.3g}); a factor is a second moment, sum x x^T: re-estimate the anchor."
        )
    values, vectors = values.flip(0).clamp(min=0), vectors.flip(1)
    keep = len(values) if rank is None else min(rank, len(values))
    kept, rho = truncated_spectrum(values, float(values.sum()), len(values), keep, tail)
    return kept, vectors[:, :keep].float().contiguous(), rho


def truncated_spectrum(
    values: torch.Tensor, trace: float, dim: int, keep: int, tail: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the top `keep` of a dim x dim factor's eigenvalues `values` (largest first, >= 0) as float32, its tail):
    with `tail="mean"`, rho = (trace - sum of the kept) / (dim - keep), trace-preserving, clamped to [0, the
    smallest kept] against rounding; "zero": 0; None when all `dim` are kept. `values` may hold only the top
    eigenvalues (a sketch, a truncated basis): `trace` carries the rest."""
    if tail not in TAILS:
        raise CFPArgumentError(f"kfac_tail={tail!r}: choose one of {list(TAILS)}.")
    kept = values[:keep].float().contiguous()
    if keep >= dim:
        return kept, None
    if tail == "zero":
        return kept, torch.zeros((), dtype=torch.float32)
    rest = (trace - float(values[:keep].double().sum())) / (dim - keep)
    ceiling = float(kept[-1]) if keep else rest
    return kept, torch.tensor(min(max(rest, 0.0), ceiling), dtype=torch.float32)


def truncate_basis(basis: KroneckerBasis, rank: int, tail: str = "mean") -> KroneckerBasis:
    """`basis` cut to the top `rank` eigenpairs of each factor (a stored basis is largest first) with `tail` for
    the rest: "mean" keeps each factor's trace (its kept eigenvalues plus its old tail times the directions it
    covered), "zero" treats the rest as free (the plain truncation the evidence compares with)."""
    parts = []
    for vectors, values, old in (
        (basis.a_vectors, basis.a_values, basis.tails()[0]),
        (basis.g_vectors, basis.g_values, basis.tails()[1]),
    ):
        dim, stored = vectors.shape[-2], values.shape[-1]
        trace = float(values.double().sum()) + float(old) * (dim - stored)
        kept, rho = truncated_spectrum(values, trace, dim, min(rank, stored), tail)
        parts.append((kept, vectors[..., : kept.shape[-1]], rho))
    return with_tails(*parts[0], *parts[1])


def check_basis(name: str, basis: KroneckerBasis, anchor_name: str) -> None:
    """Raise AnchorValidationError when a stored basis is not one: shapes that do not fit, NaN/Inf, negative
    eigenvalues, a tail that is negative, 0-dim-less or above the factor's kept eigenvalues, or columns that are
    not orthonormal."""
    where = f"Anchor {anchor_name!r}: K-FAC basis of {name!r}"
    tails = (basis.a_tail, basis.g_tail)
    for which, vectors, values, tail in zip(
        "AG", (basis.a_vectors, basis.g_vectors), (basis.a_values, basis.g_values), tails, strict=True
    ):
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
        if tail is not None:
            _check_tail(f"{where}: {which}", tail, values)
        gram = vectors.double().T @ vectors.double()
        off = (gram - torch.eye(len(values), dtype=torch.float64)).abs()
        if off.numel() and float(off.max()) > _ORTHONORMAL_TOLERANCE:
            raise AnchorValidationError(f"{where}: {which}'s eigenvectors are not orthonormal; the anchor is corrupt.")


def _check_tail(where: str, tail: torch.Tensor, values: torch.Tensor) -> None:
    """A tail is one finite number in [0, the smallest kept eigenvalue] (up to float32 rounding)."""
    if tail.numel() != 1 or not bool(torch.isfinite(tail).all()) or float(tail) < 0:
        raise AnchorValidationError(
            f"{where} has a tail of {tail.tolist()}; a tail is one eigenvalue >= 0, the anchor is corrupt."
        )
    if values.numel() and float(tail) > float(values.min()) * (1 + 1e-5) + 1e-30:
        raise AnchorValidationError(
            f"{where}: its tail {float(tail):.4g} exceeds its smallest kept eigenvalue {float(values.min()):.4g}; "
            "the tail is the mean of the eigenvalues left out, the anchor is corrupt."
        )


def dense_factors(basis: KroneckerBasis) -> tuple[torch.Tensor, torch.Tensor]:
    """(A_r, G_r), float32: X_r = U diag(values) U^T + rho (I - U U^T) for each factor (rho = 0 without a tail:
    rank-r matrices)."""
    rho_a, rho_g = basis.tails()
    return (
        _dense(basis.a_vectors, basis.a_values, rho_a),
        _dense(basis.g_vectors, basis.g_values, rho_g),
    )


def _dense(vectors: torch.Tensor, values: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
    dense = (vectors * (values - tail)) @ vectors.T
    return dense + tail * torch.eye(vectors.shape[0]) if float(tail) else dense


def stored_parts(basis: KroneckerBasis) -> dict[str, torch.Tensor]:
    """The tensors a basis stores, by part name: the eigenpairs, and its tails when it has them."""
    parts = {part: getattr(basis, part) for part in PARTS}
    if basis.tailed:
        parts.update(zip(TAIL_PARTS, basis.tails(), strict=True))
    return parts


def basis_tensors(bases: Mapping[str, KroneckerBasis]) -> dict[str, torch.Tensor]:
    """The stored tensors of the bases, by key."""
    return {stored_key(name, part): t for name, basis in bases.items() for part, t in stored_parts(basis).items()}


def read_bases(stored: Mapping[str, torch.Tensor], anchor_name: str) -> dict[str, KroneckerBasis]:
    """The bases of every K-FAC weight in `stored` (key -> tensor, as read from the files), checked."""
    bases = {}
    for name in kfac_weight_names(iter(stored)):
        missing = [part for part in PARTS if stored_key(name, part) not in stored]
        if missing:
            raise AnchorValidationError(
                f"Anchor {anchor_name!r}: the K-FAC basis of {name!r} lacks {missing}; the anchor is corrupt."
            )
        parts = {
            part: stored[stored_key(name, part)].float().contiguous()
            for part in (*PARTS, *TAIL_PARTS)
            if stored_key(name, part) in stored
        }
        basis = KroneckerBasis(**parts)
        check_basis(name, basis, anchor_name)
        bases[name] = basis
    return bases


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
            parts = stored_parts(value)
            basis = KroneckerBasis(**{k: t.detach().to("cpu", torch.float32).contiguous() for k, t in parts.items()})
            check_basis(name, basis, anchor_name)
        else:
            a, g = value
            basis = basis_from_factors(name, a, g, anchor_name)
        bases[name] = basis
    return bases


class LazyBases(Mapping[str, KroneckerBasis]):
    """weight name -> its K-FAC basis, read from the anchor's files at each access and checked (`check_basis`);
    `rows` reads only some rows of U_G (a process holding rows of the weight, FSDP2)."""

    def __init__(self, stored: Mapping[str, Stored], anchor_name: str):
        self._stored, self.anchor_name = stored, anchor_name
        self._names = kfac_weight_names(iter(stored))

    def __getitem__(self, name: str) -> KroneckerBasis:
        return self.rows(name, None)

    def rows(self, name: str, rows: slice | None) -> KroneckerBasis:
        """The basis of `name` with U_G's rows `rows` only (None: all)."""
        if name not in self._names:
            raise KeyError(name)
        parts = {}
        for part in (*PARTS, *TAIL_PARTS):
            key = stored_key(name, part)
            if key not in self._stored:
                if part in TAIL_PARTS:
                    continue
                raise AnchorValidationError(
                    f"Anchor {self.anchor_name!r}: the K-FAC basis of {name!r} lacks {part!r}; the anchor is corrupt."
                )
            index = (rows,) if part == "g_vectors" and rows is not None else None
            parts[part] = self._stored[key].read(key, index)
        basis = KroneckerBasis(**parts)
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
    where they lie (`anchor.storage.StoredTensor` entries, `LazyBases`)."""
    diagonal = {key: value for key, value in stored.items() if not is_kfac_key(key)}
    kronecker = {key: value for key, value in stored.items() if is_kfac_key(key)}
    if lazy:
        return diagonal, LazyBases(kronecker, anchor_name)
    return diagonal, read_bases(kronecker, anchor_name)
