"""What the anchor's helpers (`card`, `combine`, `compare`) read of an anchor: `NamedFisher`, a protocol that
`FisherAnchor` satisfies, so that they need not import the class that imports them."""

from collections.abc import Mapping
from typing import Any, Protocol

import torch

from ..geometry.kronecker.basis import KroneckerBasis


class NamedFisher(Protocol):
    """An anchor as its helpers read it: its name, F by canonical parameter name, the K-FAC bases of its factored
    weights (empty for a diagonal anchor), and its metadata."""

    @property
    def name(self) -> str: ...

    @property
    def fisher(self) -> Mapping[str, torch.Tensor]: ...

    @property
    def kfac(self) -> Mapping[str, KroneckerBasis]: ...

    @property
    def metadata(self) -> Mapping[str, Any]: ...
