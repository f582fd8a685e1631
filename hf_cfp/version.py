"""The library version (one place: pyproject.toml reads it, anchors record it)."""

__version__ = "0.1.0"
