"""Where CFPState keeps theta0 and F, and in which dtype: the memory a protected run pays per parameter.

Extra bytes per covered parameter on the training device, for a bf16 model (`scripts/bench_memory.py`):

    dense, F float32 (default)      theta0 in the parameter's dtype (2) + F (4)           = 6
    dense, fisher_dtype=bfloat16    theta0 (2) + F (2)                                    = 4
    sparse=s                        (index 4 + theta0 2 + F 4 or 2) x s on the device, the full theta0 and F
                                    for the metrics in (pinned) CPU memory                = 0.1 at s = 1%

theta0 is a copy of the parameter in its own dtype (exact: a bf16 weight's theta0 *is* its bf16 values); the
pull w = P / (1 + P) is recomputed from F at each step, a chunk at a time, not cached at full size.
"""

from dataclasses import InitVar, dataclass

import torch

from ..errors import CFPArgumentError

FISHER_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SPARSE_BY = ("coordinates", "mass")


@dataclass(frozen=True)
class MemoryPlan:
    """How CFPState stores what it needs (see the module's table).

    Args:
        fisher_dtype: `"float32"` (default) or `"bfloat16"`, the dtype F is kept in (halves its bytes; the
            correction and the metrics still compute in float32).
        sparse: None (dense: every protected coordinate is corrected), or a share in (0, 1): only the coordinates
            carrying the top share of each protecting anchor's F are corrected (`sparse_by`), every other one
            keeps the optimizer's proposal; theta0 and F for the metrics then live in CPU memory (pinned when
            the model is on a GPU), so the drift metrics stay exact.
        sparse_by: `"coordinates"`, `sparse` is the share of coordinates kept (those with the largest F); or
            `"mass"`, the share of F's total mass kept (the fewest coordinates holding it).
        prefix: put before each argument's name in the error messages (`"cfp_"` names the YAML keys), not kept.
    """

    fisher_dtype: str = "float32"
    sparse: float | None = None
    sparse_by: str = "coordinates"
    prefix: InitVar[str] = ""

    def __post_init__(self, prefix: str) -> None:
        if self.fisher_dtype not in FISHER_DTYPES:
            raise CFPArgumentError(
                f"{prefix}fisher_dtype must be one of {sorted(FISHER_DTYPES)}, got {self.fisher_dtype!r}."
            )
        if self.sparse is not None and not (isinstance(self.sparse, (int, float)) and 0 < self.sparse < 1):
            raise CFPArgumentError(
                f"{prefix}sparse must be None (dense) or a share in (0, 1), e.g. 0.01 for the top 1%, got "
                f"{self.sparse!r}."
            )
        if self.sparse_by not in SPARSE_BY:
            raise CFPArgumentError(f"{prefix}sparse_by must be one of {list(SPARSE_BY)}, got {self.sparse_by!r}.")

    @property
    def offloaded(self) -> bool:
        """Whether the full theta0 and F live in CPU memory (sparse mode) rather than beside the parameter."""
        return self.sparse is not None

    def home(self, param: torch.Tensor) -> torch.device:
        """Where the full theta0 and F of `param` are kept."""
        return torch.device("cpu") if self.offloaded else param.device

    def store_fisher(self, fisher: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        """F as kept for `param`: in `fisher_dtype`, at `home(param)`."""
        return _placed(fisher.to(device=self.home(param), dtype=FISHER_DTYPES[self.fisher_dtype]), param)

    def snapshot(self, local: torch.Tensor, value: torch.Tensor | None = None) -> torch.Tensor:
        """theta0 for the local parameter `local`: a copy of `value` (default: `local` itself) in the parameter's
        own dtype when it is a floating one (exact), float32 otherwise, at `home(local)`. A given `value` already
        in that form is adopted, not copied (a refreshed state keeps the theta0 tensors of the one it replaces)."""
        dtype = local.dtype if local.dtype.is_floating_point else torch.float32
        source = local.detach() if value is None else value.reshape(local.shape)
        return _placed(source.to(device=self.home(local), dtype=dtype, copy=value is None), local)


def _placed(tensor: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`tensor`, in pinned memory when it was offloaded to the CPU for a parameter on an accelerator (so that
    chunks copy to the device asynchronously)."""
    if tensor.device.type == "cpu" and param.device.type != "cpu" and torch.cuda.is_available():
        return tensor.pin_memory()
    return tensor
