"""Anchor tensors on disk: single file, shards + index, bfloat16 storage, atomic saves, corrupt files."""

import json
import os

import pytest
import torch

import hf_cfp.anchor.storage as storage
from hf_cfp.anchor.storage import INDEX_NAME, WEIGHTS_NAME, parse_size, read_tensors, write_tensors
from hf_cfp.errors import AnchorFormatError, AnchorNotFoundError, CFPArgumentError


def make_tensors(seed=0, sizes=(40, 100, 7, 300, 64)):
    generator = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.rand(n, generator=generator) * 1e-3 for i, n in enumerate(sizes)}


def snapshot(directory):
    return {name: (directory / name).read_bytes() for name in sorted(os.listdir(directory))}


def test_single_file_round_trip_is_exact(tmp_path):
    tensors = make_tensors()
    assert write_tensors(tmp_path, tensors, metadata={"cfp_anchor": "math"}) == [WEIGHTS_NAME]
    assert sorted(os.listdir(tmp_path)) == [WEIGHTS_NAME]
    loaded = read_tensors(tmp_path)
    assert list(loaded) == list(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == torch.float32 and torch.equal(loaded[name], tensor)


def test_sharded_round_trip_and_index(tmp_path):
    tensors = make_tensors()  # 511 float32 values = 2044 bytes
    written = write_tensors(tmp_path, tensors, max_shard_size=1000)
    shards = [name for name in written if name != INDEX_NAME]
    assert written[-1] == INDEX_NAME and len(shards) >= 3
    assert shards == [f"fisher-{k:05d}-of-{len(shards):05d}.safetensors" for k in range(1, len(shards) + 1)]
    assert sorted(os.listdir(tmp_path)) == sorted(written)
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in tensors.values())
    assert set(index["weight_map"]) == set(tensors)
    from safetensors import safe_open

    for shard in shards:
        with safe_open(str(tmp_path / shard), framework="pt") as handle:
            names = list(handle.keys())
            assert sum(handle.get_tensor(n).numel() * 4 for n in names) <= 1000 or len(names) == 1
        assert all(index["weight_map"][name] == shard for name in names)
    loaded = read_tensors(tmp_path)
    assert list(loaded) == list(tensors)
    assert all(torch.equal(loaded[name], tensor) for name, tensor in tensors.items())


def test_bfloat16_storage_halves_the_file_and_loads_float32(tmp_path):
    tensors = make_tensors(sizes=(4000, 3000))
    write_tensors(tmp_path / "f32", tensors)
    write_tensors(tmp_path / "bf16", tensors, dtype="bfloat16")
    loaded = read_tensors(tmp_path / "bf16")
    for name, tensor in tensors.items():
        assert loaded[name].dtype == torch.float32
        assert torch.equal(loaded[name], tensor.bfloat16().float())
    ratio = (tmp_path / "bf16" / WEIGHTS_NAME).stat().st_size / (tmp_path / "f32" / WEIGHTS_NAME).stat().st_size
    assert 0.49 < ratio < 0.55


def test_bfloat16_shards_are_sized_in_bfloat16_bytes(tmp_path):
    tensors = make_tensors()  # 2044 bytes in float32, 1022 in bfloat16
    assert write_tensors(tmp_path, tensors, max_shard_size=1100, dtype="bfloat16") == [WEIGHTS_NAME]
    written = write_tensors(tmp_path, tensors, max_shard_size=500, dtype="bfloat16")
    assert json.loads((tmp_path / INDEX_NAME).read_text())["metadata"]["total_size"] == 1022
    assert len(written) > 2


def test_float16_and_unknown_dtypes_are_refused(tmp_path):
    with pytest.raises(CFPArgumentError, match=r"float16.*6e-5.*underflow"):
        write_tensors(tmp_path, make_tensors(), dtype="float16")
    with pytest.raises(CFPArgumentError, match="float64"):
        write_tensors(tmp_path, make_tensors(), dtype="float64")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "text, expected",
    [
        ("5GB", 5 * 10**9),
        ("500MB", 500 * 10**6),
        ("10KB", 10_000),
        ("2GiB", 2 * 2**30),
        ("1.5gb", 1_500_000_000),
        (1000, 1000),
        ("1000", 1000),
        (" 3 MB ", 3 * 10**6),
        ("512B", 512),
        ("1TiB", 2**40),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "5XB", "-1MB", "0", 0, -5, True, None, 1.5, "GB", "nanGB", "infGB", "0.0001KB"])
def test_parse_size_refuses_bad_sizes(bad):
    with pytest.raises(CFPArgumentError, match="max_shard_size"):
        parse_size(bad)


def test_truncated_shard_names_the_shard(tmp_path):
    written = write_tensors(tmp_path, make_tensors(), max_shard_size=1000)
    victim = tmp_path / written[1]
    victim.write_bytes(victim.read_bytes()[:-20])
    with pytest.raises(AnchorFormatError, match=written[1]) as info:
        read_tensors(tmp_path)
    assert "truncated or corrupt" in str(info.value) and "re-save" in str(info.value)


@pytest.mark.parametrize("content", [b"", b"\x05\x00", b"\xff" * 8 + b"{}", b"\x10\x00\x00\x00\x00\x00\x00\x00{}"])
def test_corrupt_single_file_is_a_format_error(tmp_path, content):
    write_tensors(tmp_path, make_tensors())
    (tmp_path / WEIGHTS_NAME).write_bytes(content)
    with pytest.raises(AnchorFormatError, match=WEIGHTS_NAME):
        read_tensors(tmp_path)


def test_missing_shard_names_the_shard(tmp_path):
    written = write_tensors(tmp_path, make_tensors(), max_shard_size=1000)
    os.remove(tmp_path / written[0])
    with pytest.raises(AnchorFormatError, match=f"{written[0]}.*missing"):
        read_tensors(tmp_path)


def test_shard_not_matching_the_index(tmp_path):
    written = write_tensors(tmp_path, make_tensors(), max_shard_size=1000)
    (tmp_path / written[1]).write_bytes((tmp_path / written[0]).read_bytes())
    with pytest.raises(AnchorFormatError, match=f"{written[1]}.*does not match the index"):
        read_tensors(tmp_path)


def test_index_naming_a_path_outside_the_directory_is_refused(tmp_path):
    write_tensors(tmp_path, make_tensors(), max_shard_size=1000)
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    index["weight_map"]["layers.0.weight"] = "../../etc/passwd"
    (tmp_path / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(AnchorFormatError, match="passwd"):
        read_tensors(tmp_path)
    (tmp_path / INDEX_NAME).write_text("{not json")
    with pytest.raises(AnchorFormatError, match=INDEX_NAME):
        read_tensors(tmp_path)


def test_no_tensors_is_not_found(tmp_path):
    with pytest.raises(AnchorNotFoundError, match=WEIGHTS_NAME):
        read_tensors(tmp_path)
    with pytest.raises(AnchorNotFoundError):
        read_tensors(tmp_path / "absent")


@pytest.mark.parametrize("previous_shard_size", ["5GB", 1000])
def test_failed_write_leaves_previous_files_and_no_temporaries(tmp_path, monkeypatch, previous_shard_size):
    write_tensors(tmp_path, make_tensors(seed=0), max_shard_size=previous_shard_size)
    before = snapshot(tmp_path)
    real_save, calls = storage.save_file, []

    def failing_save(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 3:
            raise OSError("disk full")
        real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(storage, "save_file", failing_save)
    with pytest.raises(OSError, match="disk full"):
        write_tensors(tmp_path, make_tensors(seed=1), max_shard_size=1000)
    assert len(calls) == 3
    assert snapshot(tmp_path) == before
    assert torch.equal(read_tensors(tmp_path)["layers.0.weight"], make_tensors(seed=0)["layers.0.weight"])


def test_resaving_removes_stale_shards_and_index(tmp_path):
    (tmp_path / "cfp_config.json").write_text("{}")  # files that are not tensors are left alone
    write_tensors(tmp_path, make_tensors(seed=0), max_shard_size=500)
    many = len(os.listdir(tmp_path))
    written = write_tensors(tmp_path, make_tensors(seed=1), max_shard_size=1000)  # sharded -> fewer shards
    assert len(written) < many and sorted(os.listdir(tmp_path)) == sorted(["cfp_config.json", *written])
    write_tensors(tmp_path, make_tensors(seed=2))
    assert sorted(os.listdir(tmp_path)) == ["cfp_config.json", WEIGHTS_NAME]
    assert torch.equal(read_tensors(tmp_path)["layers.3.weight"], make_tensors(seed=2)["layers.3.weight"])
    write_tensors(tmp_path, make_tensors(seed=3), max_shard_size=1000)  # single -> sharded drops the single file
    assert WEIGHTS_NAME not in os.listdir(tmp_path)
    assert torch.equal(read_tensors(tmp_path)["layers.3.weight"], make_tensors(seed=3)["layers.3.weight"])


def test_shared_memory_and_views_are_written(tmp_path):
    base = torch.rand(10, 10)
    tensors = {"a": base, "b": base, "c": base[2:5, 1:4]}
    write_tensors(tmp_path, tensors)
    loaded = read_tensors(tmp_path)
    assert all(torch.equal(loaded[name], tensor) for name, tensor in tensors.items())
