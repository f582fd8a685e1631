"""Protection of one model: bind anchors (names, shapes, local pieces), snapshot theta0, correct
after every optimizer step, measure the drift, and keep theta0 across checkpoints.

Trainer-free: `CFPState` is what the Trainer callback drives, and what a custom loop can drive.
"""

from ..geometry.diagonal.binding import BoundTensor, bind_anchor
from ..geometry.diagonal.sparse import SparseReport, describe_sparse
from .checkpoint import SavedTheta0, has_saved_theta0, save_theta0
from .memory import MemoryPlan
from .peft_adapters import peft_view
from .state import CFPState
from .theta0 import Theta0Pieces

__all__ = [
    "BoundTensor",
    "CFPState",
    "MemoryPlan",
    "SavedTheta0",
    "SparseReport",
    "Theta0Pieces",
    "bind_anchor",
    "describe_sparse",
    "has_saved_theta0",
    "peft_view",
    "save_theta0",
]
