"""What every geometry provides, and what the layers around it hand it.

After binding, each geometry keeps a per-step state over its tensors (`GeometryState`: correct, drift, budget,
strengths, footprint) that `protection.state.CFPState` composes; the path (theta0 and the total drift) belongs to
none of them. The scoring pass (`fisher`) knows no geometry. It scores the parameters of a model and hands what it
computes to the sinks of the anchor's structure (`registry.structure`): per-sequence squared scores into the
accumulators a sink gives for its parameters (`EstimateSink.squares`), and, for a Linear-like layer whose weight a
sink factors, the layer's inputs and output gradients (`LayerSums`). Each sink then turns its sums into its part of
the anchor (`EstimatePart`). An anchor read from its files hands a geometry's artifact part the tensors it stores, or
where they lie (`Stored`, for lazy reads).
"""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..parallel import all_reduce_sum_


@dataclass(frozen=True)
class Scored:
    """One parameter the scoring pass covers: its canonical name, the tensor, and, when exactly one module owns it
    as the 2-D weight of a layer y_t = W a_t + c whose inputs a_t and output gradients the pass can hand out
    (`fisher.module_kinds.layer_kind`: "linear", or "conv1d" for GPT-2's Conv1D, which stores W^T), that kind and
    the module; else None for both."""

    name: str
    param: torch.Tensor
    layer: str | None = None
    module: torch.nn.Module | None = None


@dataclass(frozen=True)
class EstimatePlan:
    """What every sink of one estimate is told: N, the calibration sequences; `half`, the first half's count (the
    split-half statistics; 0 for none); `rank`, the eigenpairs a factor keeps (None: all); the anchor's name; and
    whether to show progress bars."""

    num_sequences: int
    half: int
    rank: int | None
    anchor_name: str
    show_progress: bool = False


class LayerSums(Protocol):
    """What the scoring pass adds one factored layer's statistics to, over the unpadded positions it scores."""

    def add_inputs(self, rows: Callable[[], torch.Tensor], gram: Callable[[], torch.Tensor]) -> None:
        """The layer inputs: `rows()`, the inputs a_t (n x in), or `gram()` = rows^T rows (formed once by the
        caller for an input several layers share)."""
        ...

    def add_output_grads(self, g: torch.Tensor, mask: torch.Tensor) -> None:
        """The output gradients g (B, T, out) of one call, at the unpadded positions `mask` (B, T)."""
        ...


@dataclass
class EstimatePart:
    """A sink's part of the anchor: diagonal F by name (float32, CPU), eigenbases by weight name, the split-half
    statistics (None when the sink has none), and metadata entries to add."""

    fisher: dict[str, torch.Tensor] = field(default_factory=dict)
    kfac: dict[str, Any] = field(default_factory=dict)
    split_half: dict | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


class EstimateSink(Protocol):
    """The running sums of one geometry in an estimate.

    The scoring pass calls `squares` and `layers` for every group of samples it scores, `positions` with the
    positions the group fed to the forward, then all-reduces `reduced()` (on the parameters' device) and
    `counts()` (float64 on `parallel.collective_device()`); when `replays`, it keeps the groups, and after the
    all-reduce scores them again into `refine()`'s layers and all-reduces `refined()`; then `finish()`."""

    params: list[torch.Tensor]  # the parameters scored (they need gradients while the estimate runs)
    replays: bool  # whether it asks for a second pass over the scored groups

    def squares(self, first_half: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(parameter, float32 accumulator) pairs: the pass adds sum_b (d/dtheta log mu_b)^2 to each."""
        ...

    def layers(self) -> list[tuple[torch.Tensor, LayerSums]]:
        """(weight, its layer sums) pairs: the pass adds the weight's layer inputs and output gradients."""
        ...

    def positions(self, count: int) -> None:
        """The group just scored fed `count` positions (prompt and response tokens) to the forward."""
        ...

    def reduced(self) -> list[torch.Tensor]: ...

    def counts(self) -> list[torch.Tensor]: ...

    def refine(self) -> list[tuple[torch.Tensor, LayerSums]]:
        """The layers of a second pass over the same groups ([] when none), after the first pass's all-reduce."""
        ...

    def refined(self) -> list[torch.Tensor]:
        """The second pass's sums, to be all-reduced before `finish`."""
        ...

    def finish(self) -> EstimatePart: ...


class Stored(Protocol):
    """Where one stored tensor lies (`anchor.storage.StoredTensor`): its full shape and stored dtype, read from
    the headers, and a read of it, or of a part of it (one slice per leading dimension), as float32."""

    @property
    def shape(self) -> torch.Size: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def read(self, key: str, index: tuple[slice, ...] | None = None) -> torch.Tensor: ...


class NamedFisher(Protocol):
    """An anchor as the geometries and the anchor's helpers read it (`anchor.FisherAnchor` satisfies it, so they
    need not import the class): its name, F by canonical parameter name, the Kronecker bases of its factored
    weights (empty for a diagonal anchor), and its metadata."""

    @property
    def name(self) -> str: ...

    @property
    def fisher(self) -> Mapping[str, torch.Tensor]: ...

    @property
    def kfac(self) -> Mapping[str, Any]: ...

    @property
    def metadata(self) -> Mapping[str, Any]: ...


class Tracked(Protocol):
    """What a geometry's per-step state reads of one trainable parameter some anchor covers, as this process holds it
    (`protection.records.TrackedTensor`): its name, the parameter, theta0 of its part, whether other processes
    hold the rest, each covering anchor's diagonal F and each factoring anchor's basis (by anchor name)."""

    @property
    def name(self) -> str: ...

    @property
    def param(self) -> torch.Tensor: ...

    @property
    def theta0(self) -> torch.Tensor: ...

    @property
    def sharded(self) -> bool: ...

    @property
    def held(self) -> Any: ...  # `binding.HeldRange`: the elements of the full parameter held here

    @property
    def fisher(self) -> dict[str, torch.Tensor]: ...

    @property
    def kfac(self) -> dict[str, Any]: ...

    def oriented(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def local(self) -> torch.Tensor: ...

    def covered_by(self, anchors: Sequence[str]) -> bool: ...

    def row(self, anchors: Sequence[str]) -> list[torch.Tensor | None]: ...


class Adapted(Protocol):
    """What a geometry reads of one LoRA-adapted base weight (`protection.records.AdaptedTensor`): the weight
    (`protection.peft_adapters.AdaptedWeight`) and each covering anchor's F or basis."""

    @property
    def weight(self) -> Any: ...

    @property
    def fisher(self) -> dict[str, torch.Tensor]: ...

    @property
    def kfac(self) -> dict[str, Any]: ...


class View(Protocol):
    """What a geometry reads of one anchor's view (`protection.records.AnchorView`): its name, its free-drift
    threshold and the tracked tensors it factors."""

    @property
    def name(self) -> str: ...

    @property
    def threshold(self) -> float: ...

    @property
    def kronecker(self) -> Sequence[Tracked]: ...


class GeometryState(Protocol):
    """A geometry's per-step state: one structure of F over the tensors it was bound to, each owning its tensors'
    correction, drift sums, KL-budget terms, pull strengths and what it keeps in memory. Sums come in two parts:
    over tensors every process holds whole (replicated: counted once) and over tensors whose pieces are spread over
    processes (sharded: added across processes); `complete` adds every state's parts with one collective."""

    def correct(self, lams: Sequence[float]) -> None:
        """The CFP correction of its protected tensors with each protecting anchor's lam, in place."""
        ...

    def drift_squares(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(replicated, sharded) float64 [1 + 2V] on the CPU in the metric order of `names.drift_keys`: at 0 the
        total drift's sum of squares, at 1 + 2v and 2 + 2v anchor v's sensitive and free ones."""
        ...

    def budget_terms(self, lams: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor]:
        """(replicated, sharded) [KL_k, dKL_k / dlam_k] of its protected tensors, float64 [2, K] on the CPU."""
        ...

    def strengths(self, lams: Sequence[float]) -> Sequence[torch.Tensor]:
        """The pull lam e of every protected coordinate (e its eigenvalue in F), a tensor at a time."""
        ...

    def kept(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(the tensors it keeps beside the parameters, those it keeps offloaded)."""
        ...

    @property
    def shard_device(self) -> torch.device | None:
        """The device its sharded sums are all-reduced on; None when it holds nothing sharded."""
        ...


def complete(geometries: Sequence[GeometryState], parts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The sum over `parts` (each geometry's (replicated, sharded) sums, in order) with the sharded ones added
    across processes: one all-reduce, on the first shard device (none when nothing is sharded)."""
    replicated = sum((r for r, _ in parts), torch.zeros_like(parts[0][0]))
    sharded = sum((s for _, s in parts), torch.zeros_like(parts[0][1]))
    device = next((g.shard_device for g in geometries if g.shard_device is not None), None)
    if device is not None:
        sharded = sharded.to(device)
        all_reduce_sum_([sharded])
    return replicated + sharded.cpu()


@dataclass(frozen=True)
class Bound:
    """What `protection.state.CFPState` hands every geometry's `Geometry.states` once the anchors are bound: the
    tracked tensors, every anchor's view (in the metrics' order), the protecting anchors' names (in the lams' order),
    and the sparse correction of the protected diagonal F (`diagonal.sparse.SparseCorrection`; None when dense)."""

    tracked: Sequence[Tracked]
    views: Mapping[str, View]
    protecting: Sequence[str]
    sparse: Any = None


@dataclass(frozen=True)
class Geometry:
    """One registered geometry (`registry`): its name, which of the scored parameters it describes (`claim`, of
    those the geometries before it in a structure left), the sink of its estimate over them, and `dense`, its
    quadratic on one parameter of an anchor formed as a float64 matrix on row-major vec(Delta) (the weight as its
    factors orient it: out x in; None when the anchor does not describe that parameter this way), and `states`, its
    per-step states over what was bound (`Bound`), which `CFPState` composes in the registry's order. `dense` is the
    contract a geometry is checked against (`tests/unit/geometry/test_conformance.py`), for small weights only."""

    name: str
    claim: Callable[[Sequence[Scored]], list[Scored]]
    sink: Callable[[list[Scored], EstimatePlan], EstimateSink]
    dense: Callable[[NamedFisher, str], torch.Tensor | None]
    states: Callable[[Bound], list[GeometryState]]
