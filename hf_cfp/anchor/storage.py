"""An anchor's tensors on disk: safetensors, one file or shards plus an index (the transformers convention).

Small anchors are one `fisher.safetensors`. Anchors larger than `max_shard_size` are
`fisher-00001-of-0000N.safetensors` shards plus `fisher.safetensors.index.json`
(`{"metadata": {"total_size": bytes}, "weight_map": {name: shard}}`), as transformers writes
`model.safetensors.index.json`. When both layouts are present the single file wins, as in
transformers. Never pickle.

What huggingface_hub's serialization helpers do here and what they cannot: its public API has no size parser (the
one its shard splitters use is private and knows decimal units only, not the "2GiB" transformers' `save_pretrained`
takes), so `parse_size` is ours; the shard plan, the staged writes and the reads stay ours too (`_plan_shards` and
`_write_staged` say why).
"""

import json
import os
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..errors import AnchorFormatError, AnchorNotFoundError, CFPArgumentError

WEIGHTS_NAME = "fisher.safetensors"
INDEX_NAME = "fisher.safetensors.index.json"
SHARD_PATTERN = re.compile(r"^fisher-\d{5}-of-\d{5}\.safetensors$")
MAX_INDEX_BYTES = 64 << 20
_STORAGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}  # readable
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*$", re.IGNORECASE)


def is_tensor_file(filename: str) -> bool:
    """True for the names this module writes: `fisher.safetensors`, its index, its shards."""
    return filename in (WEIGHTS_NAME, INDEX_NAME) or bool(SHARD_PATTERN.match(filename))


def parse_size(size: int | str) -> int:
    """Bytes in `size`: an int, or "5GB" / "500MB" / "10KB" (powers of 10) / "1GiB" (powers of 2)."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    elif isinstance(size, str) and (match := _SIZE.match(size)):
        value = int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])
    else:
        value = 0
    if value <= 0:
        raise CFPArgumentError(
            f"max_shard_size={size!r} is not a size: pass a positive number of bytes or a string such as "
            "'5GB', '500MB', '10KB' or '2GiB'."
        )
    return value


def _plan_shards(tensors: Mapping[str, torch.Tensor], limit: int, itemsize: int) -> list[list[str]]:
    """Greedy split in insertion order: each shard a run of consecutive names; a tensor larger than `limit` closes
    the shard before it and gets a shard of its own.

    Not huggingface_hub's `split_state_dict_into_shards_factory` (nor `split_torch_state_dict_into_shards`): for a
    tensor larger than the limit it opens a shard of its own and goes on filling the current one past it, so the
    shards are no longer runs of consecutive names and the count changes (tensors of 160, 400, 28, 1200 and 256
    bytes under a 1000-byte limit: 2 shards there, 3 here, which the storage tests pin); the torch variant also
    sizes a tensor in its own dtype, not the storage dtype, and puts tensors that share memory together, which
    `_stored` copies apart."""
    shards: list[list[str]] = []
    current: list[str] = []
    current_size = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * itemsize
        if current and current_size + size > limit:
            shards.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += size
    if current:
        shards.append(current)
    return shards


def temporary_path(directory: Path, filename: str) -> str:
    """A fresh hidden name beside `filename`, to write to and then rename into place. Create it with
    `open(..., "x")` (the process umask applies) or `save_tensor_file`, not `tempfile.mkstemp` (0600)."""
    return str(directory / f".{filename}.{secrets.token_hex(8)}.tmp")


def current_umask() -> int:
    """The process umask: the `Umask:` line of /proc/self/status where Linux gives it (read without changing
    anything, so safe beside other threads), else set and at once restored with `os.umask`."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save_tensor_file(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike, metadata: dict[str, str]) -> None:
    """`safetensors.torch.save_file`, then the mode `open()` would have given a new file:
    0o666 & ~umask (save_file creates 0600, which teammates on a shared filesystem cannot read).
    Every safetensors file hf-cfp writes (anchor tensors and shards, checkpoint theta0) goes through here."""
    save_file(dict(tensors), str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~current_umask())


def write_tensors(
    directory: Path,
    tensors: Mapping[str, torch.Tensor],
    max_shard_size: int | str = "5GB",
    dtype: str = "float32",
    metadata: dict[str, str] | None = None,
) -> list[str]:
    """Write `tensors` (cast to `dtype` for storage) into `directory`; return the file names written.

    Total size = sum_i numel_i * itemsize(dtype). Up to `max_shard_size` bytes: one `fisher.safetensors`;
    above: `fisher-0000k-of-0000N.safetensors` shards of at most `max_shard_size` bytes each (one tensor
    larger than that gets its own shard) plus `fisher.safetensors.index.json`. `dtype` is "float32" or
    "bfloat16"; reading always returns float32. `metadata` (str -> str) goes into every file's header.

    All files are written under temporary names in `directory` and renamed into place only once every
    one is complete; tensor files of a previous save that the new one does not use are removed after
    the renames. A failure therefore leaves the previous anchor byte-identical and no temporary files.
    """
    torch_dtype = _storage_dtype(dtype)
    if not tensors:
        raise CFPArgumentError("write_tensors got no tensors; pass {parameter_name: tensor, ...}.")
    limit = parse_size(max_shard_size)
    header = {"format": "pt", **{str(k): str(v) for k, v in (metadata or {}).items()}}
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    total_size = sum(t.numel() for t in tensors.values()) * itemsize
    plan = [list(tensors)] if total_size <= limit else _plan_shards(tensors, limit, itemsize)
    if len(plan) == 1:
        outputs = [(WEIGHTS_NAME, plan[0])]
    else:
        outputs = [(f"fisher-{k:05d}-of-{len(plan):05d}.safetensors", names) for k, names in enumerate(plan, 1)]
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = _write_staged(directory, outputs, tensors, torch_dtype, header, total_size)
    for stale in sorted(set(filter(is_tensor_file, os.listdir(directory))) - set(written)):
        os.remove(directory / stale)
    return written


def _storage_dtype(dtype: str) -> torch.dtype:
    """The torch dtype of a storage dtype name ("float32", "bfloat16"); CFPArgumentError for any other."""
    if dtype == "float16":
        raise CFPArgumentError(
            "dtype='float16' is refused for anchor storage: Fisher values are means of squared scores, often "
            "far below float16's smallest normal (6e-5), and would underflow to zero or lose precision. "
            "Use dtype='bfloat16' (float32's range, half the size) or 'float32'."
        )
    if dtype not in _STORAGE_DTYPES:
        raise CFPArgumentError(f"dtype={dtype!r} is not a storage dtype for anchors: use 'float32' or 'bfloat16'.")
    return _STORAGE_DTYPES[dtype]


def _write_staged(
    directory: Path,
    outputs: list[tuple[str, list[str]]],
    tensors: Mapping[str, torch.Tensor],
    dtype: torch.dtype,
    header: dict[str, str],
    total_size: int,
) -> list[str]:
    """Write each (file name, tensor names) of `outputs`, and the index when there are several, under temporary
    names in `directory`, then rename them all into place; no temporary file is left, whatever fails. Returns the
    file names written.

    Not huggingface_hub's `save_torch_state_dict`, which writes the same file names and index: it removes the
    previous files first and writes in place (a failure mid-save loses the previous anchor), puts the metadata in
    the single file's or the index's header only (here every file carries it) and leaves save_file's 0600 mode."""
    staged = []
    try:
        for filename, names in outputs:
            tmp = temporary_path(directory, filename)
            staged.append((tmp, filename))
            save_tensor_file(_stored(tensors, names, dtype), tmp, metadata=header)
        if len(outputs) > 1:
            index = {
                "metadata": {"total_size": total_size},
                "weight_map": {name: filename for filename, names in outputs for name in names},
            }
            tmp = temporary_path(directory, INDEX_NAME)
            staged.append((tmp, INDEX_NAME))
            with open(tmp, "x") as handle:
                json.dump(index, handle, indent=2, sort_keys=True)
        for tmp, filename in staged:
            os.replace(tmp, directory / filename)
    finally:
        for tmp, _ in staged:
            if os.path.exists(tmp):
                os.remove(tmp)
    return [filename for _, filename in staged]


def _stored(tensors: Mapping[str, torch.Tensor], names: list[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors `names` as one file stores them: on the CPU, in `dtype`, contiguous, none sharing memory."""
    shard, storages = {}, set()
    for name in names:
        tensor = tensors[name].detach().to(device="cpu", dtype=dtype).contiguous()
        pointer = tensor.untyped_storage().data_ptr()
        shard[name] = tensor.clone() if pointer in storages else tensor  # save_file refuses shared memory
        storages.add(pointer)
    return shard


@dataclass(frozen=True)
class StoredTensor:
    """Where one anchor tensor lies: its file, its full shape and stored dtype (from the file's header), and
    how error messages name the file."""

    path: Path
    shape: torch.Size
    dtype: torch.dtype
    what: str  # "'<file>'" or "shard '<name>' listed in '<index>'"

    def read(self, key: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """`read_stored(key, self, index)`: what a geometry's lazy reads call (`geometry.base.Stored`)."""
        return read_stored(key, self, index)


def _corrupt(what: str, error: Exception) -> AnchorFormatError:
    return AnchorFormatError(
        f"The anchor's {what} is truncated or corrupt ({error}); download the anchor again or re-save it."
    )


def _read_header(path: Path, expected: list[str] | None, index_path: Path | None) -> dict[str, StoredTensor]:
    """name -> StoredTensor for every tensor in `path`, checking the names against the index and that every
    tensor is stored as floats; reads the header only (safetensors checks that the data covers it)."""
    what = f"shard {path.name!r} listed in {str(index_path)!r}" if index_path else repr(str(path))
    if not path.is_file():
        raise AnchorFormatError(f"The anchor's {what} is missing; download the anchor again or re-save it.")
    try:
        with safe_open(str(path), framework="pt") as handle:
            names = list(handle.keys())
            if expected is not None and set(names) != set(expected):
                missing, extra = sorted(set(expected) - set(names)), sorted(set(names) - set(expected))
                raise AnchorFormatError(
                    f"The anchor's {what} does not match the index: it lacks {missing[:3]} and has unlisted "
                    f"{extra[:3]}. The shards come from different saves; download or re-save the anchor."
                )
            stored = {}
            for name in names:
                part = handle.get_slice(name)
                if part.get_dtype() not in _DTYPES:
                    raise AnchorFormatError(
                        f"The anchor's {what} stores {name!r} as {part.get_dtype()}; Fisher values are floats."
                    )
                stored[name] = StoredTensor(path, torch.Size(part.get_shape()), _DTYPES[part.get_dtype()], what)
    except (SafetensorError, OSError, ValueError, RuntimeError) as error:
        if isinstance(error, AnchorFormatError):
            raise
        raise _corrupt(what, error) from error
    return stored


def read_stored(name: str, entry: StoredTensor, index: tuple[slice, ...] | None = None) -> torch.Tensor:
    """A float32 copy of the stored tensor `name`, or of its part `index` (one slice per leading dimension, as
    `safe_open(...).get_slice(name)[index]` reads it: only that part of the file is touched)."""
    try:
        with safe_open(str(entry.path), framework="pt") as handle:
            tensor = handle.get_tensor(name) if index is None else handle.get_slice(name)[index]
            return tensor.to(torch.float32, copy=True).contiguous()
    except (SafetensorError, OSError, ValueError, RuntimeError) as error:
        raise _corrupt(entry.what, error) from error


def _read_index(index_path: Path) -> dict[str, str]:
    try:
        if index_path.stat().st_size > MAX_INDEX_BYTES:
            raise ValueError(f"over {MAX_INDEX_BYTES} bytes")
        weight_map = json.loads(index_path.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise ValueError("'weight_map' is not a mapping of names to file names")
        if not weight_map:
            raise ValueError("'weight_map' is empty")
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise AnchorFormatError(
            f"{str(index_path)!r} is not a valid shard index ({error}); re-save the anchor."
        ) from error
    for shard in set(weight_map.values()):
        if not SHARD_PATTERN.match(shard):
            raise AnchorFormatError(
                f"{str(index_path)!r} names shard {shard!r}, not a file name of the form "
                "'fisher-00001-of-00002.safetensors'; the index is corrupt or was not written by hf-cfp."
            )
    return weight_map


def stored_tensors(directory: Path) -> dict[str, StoredTensor]:
    """name -> StoredTensor for `fisher.safetensors`, or for the index and its shards, from the headers alone.

    Raises AnchorNotFoundError when `directory` holds neither, and AnchorFormatError naming the file when
    a shard is missing, does not hold exactly the names the index gives it, is truncated or corrupt, or
    stores a tensor as other than floats.
    """
    directory = Path(directory)
    single, index_path = directory / WEIGHTS_NAME, directory / INDEX_NAME
    if single.is_file():
        return _read_header(single, None, None)
    if not index_path.is_file():
        raise AnchorNotFoundError(
            f"{str(directory)!r} holds no anchor tensors: neither {WEIGHTS_NAME} nor {INDEX_NAME} is there."
        )
    weight_map = _read_index(index_path)
    by_shard: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        by_shard.setdefault(shard, []).append(name)
    stored = {}
    for shard in sorted(by_shard):
        stored.update(_read_header(directory / shard, by_shard[shard], index_path))
    return {name: stored[name] for name in weight_map}


def read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """float32 CPU tensors of every name in `stored_tensors(directory)` (with its errors), one at a time."""
    return {name: read_stored(name, entry) for name, entry in stored_tensors(directory).items()}
