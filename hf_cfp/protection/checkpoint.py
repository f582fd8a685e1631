"""theta0 saved with each Trainer checkpoint, so a resumed run keeps the original path origin.

Layout-independent: every saved tensor is a run of elements [start, stop) of its parameter's
row-major flattened full tensor, recorded in the file header (`cfp_ranges`: name -> [start, stop,
numel]). Each process writes the pieces it holds of sharded parameters (FSDP2, FSDP1, ZeRO-3)
to `cfp_theta0-rank{r}-of-{n}.safetensors`; rank 0 also writes the replicated ones (DDP, one
process). Resuming, each process reads the elements it holds now from whichever files have
them, so a checkpoint saved by n processes resumes under any number and any layout.

On a PEFT LoRA model the origin of an adapted weight is its LoRA factors at train begin (`AdaptedWeight.snapshot`:
s0, B0, A0 per active adapter). They are replicated (sharded factors are refused at bind), so rank 0 writes
them into its file as `cfp_lora0/<weight>/<adapter>/B` and `.../A` (float32), with `cfp_lora0` in the header:
weight -> [[adapter, s0], ...]. `SavedTheta0.restore_lora` puts them back.

Disk cost per checkpoint: one copy of each covered trainable parameter in its own dtype (2 bytes for bf16), in
total, plus one float32 copy of the covered LoRA factors.
"""

import json
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from ..anchor.storage import save_tensor_file
from ..errors import CFPError
from ..geometry.binding import HeldRange
from ..parallel import process_rank_and_count
from .peft_adapters import AdaptedWeight
from .state import CFPState

FILE_PATTERN = "cfp_theta0*.safetensors"
RANGES_KEY = "cfp_ranges"
LORA_KEY = "cfp_lora0"  # header: weight -> [[adapter, s0], ...]; tensors cfp_lora0/<weight>/<adapter>/{B,A}


def has_saved_theta0(checkpoint_dir: str | Path) -> bool:
    """Whether `checkpoint_dir` holds theta0 files written by `save_theta0`."""
    return Path(checkpoint_dir).is_dir() and any(Path(checkpoint_dir).glob(FILE_PATTERN))


def save_theta0(protection: CFPState, checkpoint_dir: str | Path) -> None:
    """Write this process's theta0 pieces into the checkpoint directory (every process calls this)."""
    rank, count = process_rank_and_count()
    tensors, ranges = {}, {}
    for tracked in protection.tensors:
        name, held = tracked.name, tracked.held
        if not tracked.sharded and rank != 0:  # replicated: rank 0 writes it once
            continue
        if held.start is None or held.stop is None:
            raise CFPError(
                f"Cannot save theta0 of {name!r}: this process's shard is not one contiguous run of the "
                "parameter's elements (a DTensor sharded on a dimension other than the first). Shard "
                "parameters on dim 0 (FSDP2's default) to checkpoint a protected run."
            )
        tensors[name] = tracked.theta0.detach().reshape(-1).cpu()
        ranges[name] = [held.start, held.stop, held.numel]
    metadata = {"format": "pt", RANGES_KEY: json.dumps(ranges)}
    if rank == 0 and protection.adapted:  # LoRA factors are replicated: rank 0 writes their snapshot once
        scales = {}
        for weight in protection.adapted:
            scales[weight.name] = [[a, s0] for a, (s0, _, _) in zip(weight.adapters, weight.snapshot, strict=True)]
            for adapter, (_, b0, a0) in zip(weight.adapters, weight.snapshot, strict=True):
                tensors[_lora_key(weight.name, adapter, "B")] = b0.detach().cpu().contiguous()
                tensors[_lora_key(weight.name, adapter, "A")] = a0.detach().cpu().contiguous()
        metadata[LORA_KEY] = json.dumps(scales)
    if tensors:
        Path(checkpoint_dir).mkdir(parents=True, exist_ok=True)
        path = Path(checkpoint_dir) / f"cfp_theta0-rank{rank:05d}-of-{count:05d}.safetensors"
        save_tensor_file(tensors, path, metadata=metadata)


def _lora_key(weight: str, adapter: str, factor: str) -> str:
    return f"{LORA_KEY}/{weight}/{adapter}/{factor}"


class SavedTheta0:
    """The theta0 saved in one checkpoint directory, read piece by piece (a `theta0.Theta0Reader`).

    Files written before ranges were recorded (`cfp_theta0.safetensors` with full tensors) read as
    whole parameters.
    """

    def __init__(self, checkpoint_dir: str | Path):
        self.directory = Path(checkpoint_dir)
        self.files = sorted(self.directory.glob(FILE_PATTERN))
        if not self.files:
            raise CFPError(f"No saved theta0 ({FILE_PATTERN}) in {str(self.directory)!r}.")

    def read(self, wanted: list[tuple[str, HeldRange]]) -> dict[str, torch.Tensor]:
        """name -> float32 elements [start, stop) of each wanted parameter's flattened saved theta0.

        Raises CFPError naming the parameter when the saved pieces do not cover those elements or
        were saved for a parameter of another size.
        """
        with ExitStack() as stack:
            handles = [stack.enter_context(safe_open(str(f), framework="pt")) for f in self.files]
            pieces: dict[str, list[tuple[int, int, int, object]]] = {}
            for handle in handles:
                ranges = json.loads((handle.metadata() or {}).get(RANGES_KEY, "{}"))
                for key in handle.keys():
                    shape = handle.get_slice(key).get_shape()
                    start, stop, numel = ranges.get(key, [0, _numel(shape), _numel(shape)])
                    pieces.setdefault(key, []).append((start, stop, numel, handle))
            return {name: self._assemble(name, held, pieces.get(name, [])) for name, held in wanted}

    def restore_lora(self, adapted: list[AdaptedWeight]) -> None:
        """Set each adapted weight's snapshot (s0, B0, A0 per adapter) to the one saved at train begin.

        Raises CFPError naming the weight when the checkpoint holds no snapshot for it, or one of other
        adapters or factor shapes.
        """
        with ExitStack() as stack:
            handles = [stack.enter_context(safe_open(str(f), framework="pt")) for f in self.files]
            saved = {}
            for handle in handles:
                for name, scales in json.loads((handle.metadata() or {}).get(LORA_KEY, "{}")).items():
                    saved[name] = (handle, scales)
            for weight in adapted:
                weight.snapshot = self._snapshot(weight, *saved.get(weight.name, (None, None)))

    def _snapshot(self, weight: AdaptedWeight, handle, scales: list | None) -> list:
        where = f"The checkpoint {str(self.directory)!r}"
        todo = (
            "Resume with the model, adapters (target_modules, r) and anchors of the original run, from a checkpoint "
            "saved while CFPCallback was attached; or delete its cfp_theta0*.safetensors files and pass "
            "CFPCallback(..., restart_path_on_resume=True) to measure from the resumed weights instead."
        )
        if scales is None:
            raise CFPError(
                f"{where} holds no LoRA factors at train begin for the adapted weight {weight.name!r}. " + todo
            )
        adapters = [a for a, _ in scales]
        if adapters != list(weight.adapters):
            raise CFPError(
                f"{where} holds the train-begin LoRA factors of adapters {adapters} for {weight.name!r}; the model "
                f"has the active adapters {list(weight.adapters)}. {todo}"
            )
        snapshot = []
        for (adapter, s0), (_, b_now, a_now) in zip(scales, weight.snapshot, strict=True):
            b0, a0 = (handle.get_tensor(_lora_key(weight.name, adapter, f)) for f in ("B", "A"))
            if b0.shape != b_now.shape or a0.shape != a_now.shape:
                raise CFPError(
                    f"{where} holds LoRA factors B {tuple(b0.shape)}, A {tuple(a0.shape)} of adapter {adapter!r} for "
                    f"{weight.name!r}; the model's are B {tuple(b_now.shape)}, A {tuple(a_now.shape)}. {todo}"
                )
            snapshot.append((float(s0), b0.to(b_now.device, torch.float32), a0.to(a_now.device, torch.float32)))
        return snapshot

    def _assemble(self, name: str, held: HeldRange, pieces: list) -> torch.Tensor:
        if held.start is None or held.stop is None:
            raise CFPError(f"Cannot restore theta0 of {name!r}: this process's shard is not contiguous.")
        out = torch.empty(held.stop - held.start, dtype=torch.float32)
        covered = 0
        for start, stop, numel, handle in pieces:
            if numel != held.numel:
                raise CFPError(
                    f"The theta0 saved in {str(self.directory)!r} has {numel} elements for {name!r}, the model "
                    f"{held.numel}: resume with the model and anchors of the original run."
                )
            low, high = max(start, held.start), min(stop, held.stop)
            if low < high:
                out[low - held.start : high - held.start] = _flat_slice(handle, name, low - start, high - start)
                covered += high - low
        if covered != held.stop - held.start:
            raise CFPError(
                f"The theta0 saved in {str(self.directory)!r} does not cover parameter {name!r} (elements "
                f"{held.start}..{held.stop} of {held.numel}; {covered} found): resume with the anchors of the "
                "original run, from a checkpoint all of whose cfp_theta0-rank*.safetensors files were kept."
            )
        return out


def _numel(shape: list[int]) -> int:
    return int(torch.Size(shape).numel())


def _flat_slice(handle, name: str, low: int, high: int) -> torch.Tensor:
    """Elements [low, high) of the saved tensor `name`, flattened (1-D files are sliced on disk)."""
    view = handle.get_slice(name)
    if len(view.get_shape()) == 1:
        return view[low:high].float()
    return handle.get_tensor(name).reshape(-1)[low:high].float()
