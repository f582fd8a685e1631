"""What the anchor's helpers (`card`, `combine`, `compare`) read of an anchor: `NamedFisher`, a protocol that
`FisherAnchor` satisfies, so that they need not import the class that imports them."""

from collections.abc import Mapping
from typing import Any, Protocol

import torch


class NamedFisher(Protocol):
    """An anchor as its helpers read it: its name, F by canonical parameter name, and its metadata."""

    @property
    def name(self) -> str: ...

    @property
    def fisher(self) -> Mapping[str, torch.Tensor]: ...

    @property
    def metadata(self) -> Mapping[str, Any]: ...
