"""The geometries of F, one package per structure, each whole: its math, its estimate sink, its part of the anchor
artifact (keys, validation, lazy reads) and its LoRA rules (`diagonal/`, `kronecker/`), behind the small protocols
of `base` and looked up by name in `registry`, the one place that lists them.

Layering: this layer sits below `anchor` and `fisher` (which look a structure's parts up here) and above `ops` and
`parallel`; nothing here imports `anchor`, `fisher` or `protection`. Importing the package loads no torch (the
command line reads `registry.STRUCTURES`).
"""

from .registry import GEOMETRIES, STRUCTURES, geometry, structure

__all__ = ["GEOMETRIES", "STRUCTURES", "geometry", "structure"]
