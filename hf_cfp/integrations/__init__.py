"""Glue to the Hugging Face training stack: the Trainer callback, metrics reaching every reporter,
and resolving what a user passes as an anchor (object, directory, Hub reference)."""

from .callback import CFPCallback
from .kl_callback import KLToBaseCallback
from .loop import CFP

__all__ = ["CFP", "CFPCallback", "KLToBaseCallback"]
