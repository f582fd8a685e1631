"""The Kronecker-factored (K-FAC) geometry: F_W ~ A (x) G for a Linear-like weight W (out x in), kept as the top
eigenpairs of each factor and a tail. Followed from estimate to anchor: the factor sums (`factors`, `sketch` for a
factor too wide to form) fed by the scoring pass into its sink (`sink`), their eigenbases stored in the anchor
(`artifact`: keys, checks, lazy reads, truncation) and read coordinate by coordinate (`views`)."""

from ..base import Geometry
from .sink import KroneckerSink, kfac_weights

GEOMETRY = Geometry("kronecker", kfac_weights, KroneckerSink)

__all__ = ["GEOMETRY", "KroneckerSink", "kfac_weights"]
