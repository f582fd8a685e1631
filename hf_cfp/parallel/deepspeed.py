"""DeepSpeed ZeRO-1/2/3: the correction must reach the optimizer's fp32 master partitions.

Under ZeRO-1/2 every process holds the full (bit16 or fp32) model parameters, but the optimizer
steps its own fp32 master copy, split into one flat partition per process, and copies it back
into the model parameters after each step. A correction applied to the model parameters alone is
therefore overwritten at the next step (on 2 CPU processes the run ended 3e-2 away from the
single-process one). So each process also corrects its fp32 master partition: for every
protected parameter, the fragment of that partition it owns (DeepSpeed's `param._hp_mapping`:
a view into the partition plus the offset of the fragment inside the flattened parameter), with
the matching slice of F and theta0. The model parameters are corrected as under DDP (full F and
theta0, the same on every process), so they agree with the master copy: bitwise for fp32 models,
within one rounding of the parameter dtype for bf16/fp16 ones until the next step rewrites them
from the master copy. Parameters corrected elsewhere (a PeftModel's LoRA factors, rewritten whole by
`protection.adapter_correction`) are `followed`: `MasterCorrection.carry` runs that correction and carries
it into their master fragments (the corrected values for fp32 parameters, bitwise as without DeepSpeed; the
change new - old for bf16/fp16 ones, so the master copy keeps its precision).

Under ZeRO-3 a parameter's data is this process's partition of the flattened parameter
(`param.ds_tensor`, padded at the end; `param.data` is empty between uses), and the fp32 master
copy is a partition of the same offsets. CFP binds the slice of F at those offsets
(`bind_zero3`), takes theta0 from the partition, corrects the partition (through
`shards.local_tensor`) and the fp32 master partition (`Zero3MasterCorrection`), and sums the
metrics' squares over partitions (all-reduced: disjoint pieces). Parameters kept gathered by the
persistence thresholds (`ds_persist`) hold a full copy that the next forward uses: after the
correction they are re-gathered from their corrected partitions, as DeepSpeed does after a step.

Nothing here imports deepspeed: the optimizer is recognized by its attributes (its import-time CPU note is
silenced while an `hf-cfp` command runs, `hf_cfp.quiet`).
"""

import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..errors import CFPError
from ..ops import proximal_pull_
from .fsdp1 import FlatPiece


def uses_deepspeed(model: torch.nn.Module, args=None) -> bool:
    """Whether this training run is driven by DeepSpeed (Trainer args, accelerate env or ZeRO-3 params)."""
    return (
        bool(getattr(args, "deepspeed", None))
        or os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true"
        or any(hasattr(p, "ds_id") for p in model.parameters())
    )


def zero_optimizer(optimizer):
    """The DeepSpeed ZeRO optimizer inside `optimizer` (unwrapping accelerate's wrapper), or None."""
    for _ in range(4):
        if optimizer is None:
            return None
        if hasattr(optimizer, "single_partition_of_fp32_groups") or hasattr(optimizer, "fp32_partitioned_groups_flat"):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
    return None


def is_zero3(zero) -> bool:
    """Whether the ZeRO optimizer `zero` (`zero_optimizer`) is ZeRO-3's."""
    return hasattr(zero, "fp32_partitioned_groups_flat")


def check_supported(model: torch.nn.Module, optimizer) -> None:
    """Raise CFPError unless `optimizer` is a ZeRO-1/2/3 optimizer whose partitions CFP can correct."""
    zero = zero_optimizer(optimizer)
    if is_zero3(zero):
        if getattr(zero, "swap_optimizer", False) or getattr(zero, "params_in_nvme_and_cpu", False):
            raise CFPError(
                "CFPCallback under DeepSpeed ZeRO-3 does not support NVMe offload (its fp32 master "
                "partitions are swapped out between steps). Offload to the CPU or not at all."
            )
        if any(p.requires_grad and not hasattr(p, "ds_tensor") for p in model.parameters()):
            raise CFPError(
                "CFPCallback under DeepSpeed ZeRO-3: a trainable parameter is not partitioned "
                "(no `ds_tensor`); this DeepSpeed version is not supported."
            )
        return
    if zero is None:
        raise CFPError(
            f"CFPCallback runs under DeepSpeed but its `optimizer` argument is not a ZeRO optimizer (got "
            f"{type(optimizer).__name__}); without it the fp32 master weights would undo the correction. Use "
            f"transformers.Trainer (or a TRL trainer, which pass the optimizer) with zero_optimization.stage 1, "
            f"2 or 3, or train with DDP or FSDP2."
        )
    for param in model.parameters():
        if param.requires_grad and not hasattr(param, "_hp_mapping"):
            raise CFPError(
                "CFPCallback under DeepSpeed ZeRO-1/2: a trainable parameter is not linked to the optimizer's "
                "fp32 master partition (no `_hp_mapping`); this DeepSpeed version is not supported."
            )


class MasterCorrection:
    """This process's fragments of the ZeRO-1/2 fp32 master partition, with F and theta0 sliced to match."""

    def __init__(self, params, theta0, fishers, followed=()):
        self.followed = [p for p in followed if _lp_fragment(p) is not None]
        self.fragments: list[torch.Tensor] = []
        self.theta0: list[torch.Tensor] = []
        self.fishers: list[list[torch.Tensor | None]] = []
        for param, t0, row in zip(params, theta0, fishers, strict=True):
            start, numel = master_fragment_range(param)
            if numel == 0:  # this process owns no part of the parameter
                continue
            device = param._hp_mapping.get_hp_fragment().device  # the master copy may be offloaded to the CPU
            self.fragments.append(param)
            self.theta0.append(t0.reshape(-1)[start : start + numel].to(device, copy=True))
            self.fishers.append(
                [f.reshape(-1)[start : start + numel].to(device, copy=True) if f is not None else None for f in row]
            )

    @torch.no_grad()
    def carry(self, correct_followed: Callable[[], None]) -> None:
        """Run `correct_followed` (it rewrites the followed parameters) and carry its effect into their fp32
        master fragments, which the next optimizer step would otherwise copy back over it."""
        before = [_lp_fragment(p).float() for p in self.followed if p.dtype != torch.float32]
        correct_followed()
        changes = iter(before)
        for param in self.followed:
            new, hp = _lp_fragment(param), param._hp_mapping.get_hp_fragment()
            assert new is not None
            if param.dtype == torch.float32:
                hp.copy_(new)
            else:
                hp.add_((new.float() - next(changes)).to(hp.device))

    def correct(self, lams: list[float]) -> None:
        if not self.fragments:
            return
        # Resolved at each use: the fragment is a view into the current fp32 partition.
        hp = [p._hp_mapping.get_hp_fragment() for p in self.fragments]
        proximal_pull_(hp, self.theta0, self.fishers, lams)


class Zero3MasterCorrection:
    """ZeRO-3: the fp32 master partitions of the protected parameters, corrected with the same partition
    slices of F and theta0 as the parameters' own partitions; then persisted parameters are re-gathered."""

    def __init__(self, optimizer, model, params, theta0, fishers):
        self.optimizer = optimizer
        self.params = list(params)
        self.theta0 = list(theta0)
        self.fishers = [list(row) for row in fishers]
        self.persisted = [p for p in model.parameters() if getattr(p, "ds_persist", False)]

    def carry(self, correct_followed: Callable[[], None]) -> None:
        """Run `correct_followed`: ZeRO-3 has nothing to carry (LoRA factors partitioned by ZeRO-3 are refused
        at bind, `protection.peft_adapters`)."""
        correct_followed()

    @torch.no_grad()
    def correct(self, lams: list[float]) -> None:
        for param, t0, row in zip(self.params, self.theta0, self.fishers, strict=True):
            if t0.numel():
                read, write = zero3_master_partition(self.optimizer, param)
                hp = read()
                on_hp = [f.to(hp.device) if f is not None else None for f in row]
                proximal_pull_([hp.view(-1)[: t0.numel()]], [t0.to(hp.device)], [on_hp], lams)
                write(hp)
        if self.persisted:  # their gathered copies predate the correction: release and gather them again
            self.persisted[0].partition(self.persisted)
            self.persisted[0].all_gather(self.persisted)


def master_fragment_range(param) -> tuple[int, int]:
    """(start, numel): the elements of the flattened ZeRO-1/2 parameter `param` whose fp32 master this process owns
    (`param._hp_mapping`; numel 0 when it owns none)."""
    mapping = getattr(param, "_hp_mapping", None)
    if mapping is None:
        return 0, 0
    return mapping.lp_fragment_address.start, mapping.lp_fragment_address.numel


def _lp_fragment(param) -> torch.Tensor | None:
    """The fragment of the ZeRO-1/2 model parameter `param` whose fp32 master this process owns (a flat view),
    or None when it owns none."""
    start, numel = master_fragment_range(param)
    return param.detach().reshape(-1)[start : start + numel] if numel else None


def zero3_master_partition(zero, param) -> tuple[Callable[[], torch.Tensor], Callable[[torch.Tensor], None]]:
    """(read, write) of this process's ZeRO-3 fp32 master partition of `param` (padded at the end): `read` gives it
    on the accelerator (a view into the partition, or a copy when it is offloaded), `write` sets it back."""
    return (lambda: zero.get_local_fp32_param(param)), (lambda value: zero.set_local_hp_param(value, param))


def partition_range(param) -> tuple[int, int]:
    """(start, numel) of this process's ZeRO-3 partition of `param` in the flattened parameter, padding excluded."""
    size = param.ds_tensor.numel()
    start = dist.get_rank(group=param.ds_process_group) * size
    return start, max(0, min(size, param.ds_numel - start))


def local_partition(param) -> torch.Tensor:
    """This process's ZeRO-3 partition of `param` (1-D, padding excluded); resolved at each use."""
    return param.ds_tensor.view(-1)[: partition_range(param)[1]]


def zero3_pieces(model: torch.nn.Module) -> dict:
    """id(param) -> FlatPiece(full shape `ds_shape`, this process's partition range) for every
    ZeRO-3 parameter, so that `binding.bind_anchor` slices F to the partition as for FSDP1 pieces."""
    pieces = {}
    for param in model.parameters():
        if hasattr(param, "ds_tensor"):
            start, numel = partition_range(param)
            pieces[id(param)] = FlatPiece(torch.Size(param.ds_shape), start, start + numel, param.requires_grad)
    return pieces


def master_correction(model, optimizer, params, theta0, fishers, followed=()):
    """The fp32 master correction for the protected `params` (`fishers[i]`: each protecting anchor's F on
    `params[i]`, or None; and the `followed` parameters corrected elsewhere, see `MasterCorrection.carry`)
    under DeepSpeed ZeRO, else None."""
    zero = zero_optimizer(optimizer)
    if zero is None:
        return None
    check_supported(model, optimizer)
    if is_zero3(zero):
        return Zero3MasterCorrection(zero, model, params, theta0, fishers)
    return MasterCorrection(params, theta0, fishers, followed)
