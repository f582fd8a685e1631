"""The one registry of the structures of F: a structure's name (`estimate_fisher(structure=...)`, `hf-cfp estimate
--structure`) -> the geometries it is made of, and a geometry's name -> the package that holds it whole.

A structure lists its geometries: each after the first claims the scored parameters it can describe
(`base.Geometry.claim`) from those the ones before it left, and the first, the default, takes the rest; their sinks
are fed, all-reduced and finished in this order. "kfac" is the diagonal geometry on every parameter but the
Linear-like weights the Kronecker one factors.

`protection.state.CFPState` composes the per-step states of every geometry in `GEOMETRIES`, in its order
(`base.Geometry.states`). Nothing here imports torch (the command line's parser reads `STRUCTURES`); `geometry`
imports a package when it is first asked for (as `hf_cfp.exports` does for the public names). A new geometry is
one package under `hf_cfp/geometry/` exposing `GEOMETRY` (a `base.Geometry`) and one line in `GEOMETRIES`.
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what `geometry` returns, for type checkers
    from .base import Geometry

# geometry name -> the package (relative to this one) whose `GEOMETRY` it is
GEOMETRIES: dict[str, str] = {"diagonal": "diagonal", "kronecker": "kronecker"}

# structure name -> its geometries: the first takes what the others (claiming in order) leave
STRUCTURES: dict[str, tuple[str, ...]] = {"diagonal": ("diagonal",), "kfac": ("diagonal", "kronecker")}


def geometry(name: str) -> "Geometry":
    """The registered geometry `name` (its package's `GEOMETRY`). Raises KeyError for an unknown name."""
    return importlib.import_module(f".{GEOMETRIES[name]}", __package__).GEOMETRY


def structure(name: str) -> list["Geometry"]:
    """The geometries of structure `name`, the default first. Raises KeyError for an unknown name."""
    return [geometry(part) for part in STRUCTURES[name]]
