"""An anchor kept in its files (`FisherAnchor.from_pretrained(..., lazy=True)`, hf_cfp/geometry/diagonal/artifact.py):
the same F, names, statistics and errors as the anchor loaded whole, flat ranges and blocks equal to slices of the full
tensors while reading only the rows that hold them, values checked as they are read, and binding it to a model
giving the same CFPState as the anchor in memory."""

import math

import pytest
import torch
from safetensors.torch import save_file
from support.tiny import anchor_for, tiny_llama

from hf_cfp import FisherAnchor
from hf_cfp.anchor.storage import WEIGHTS_NAME
from hf_cfp.errors import AnchorFormatError, AnchorValidationError
from hf_cfp.geometry.diagonal.artifact import LazyFisher, TensorsOf, fisher_shape, read_block, read_flat
from hf_cfp.ops import free_threshold
from hf_cfp.protection import CFPState

SHAPES = {"model.embed.weight": (7, 5), "model.norm.weight": (6,), "model.conv.weight": (3, 4, 2), "scale": ()}


def make_anchor(seed=0):
    generator = torch.Generator().manual_seed(seed)
    fisher = {name: torch.rand(shape, generator=generator) for name, shape in SHAPES.items()}
    return FisherAnchor(fisher, name="math", metadata={"base_model": "tiny"})


@pytest.fixture(params=["single", "shards", "bfloat16"])
def saved(request, tmp_path):
    """(the anchor in memory as it loads back, its directory) for one file, shards of 64 bytes, bf16 storage."""
    options = {"single": {}, "shards": {"max_shard_size": 64}, "bfloat16": {"dtype": "bfloat16"}}[request.param]
    make_anchor().save_pretrained(tmp_path, **options)
    return FisherAnchor.from_pretrained(tmp_path), tmp_path


def test_a_lazy_anchor_has_the_eager_one_s_names_values_and_metadata_with_the_saved_statistics(saved):
    eager, directory = saved
    lazy = FisherAnchor.from_pretrained(directory, lazy=True)
    assert isinstance(lazy.fisher, LazyFisher) and lazy.fisher.bytes_read == 0  # headers only
    assert lazy.name == "math" and repr(lazy) == repr(eager)
    saved_values = {key: make_anchor().metadata[key] for key in ("statistics", "module_types")}
    assert lazy.metadata == {**eager.metadata, **saved_values}  # as saved (bfloat16: of the values before rounding)
    assert list(lazy.fisher) == list(eager.fisher) and len(lazy.fisher) == 4 and "scale" in lazy.fisher
    for name, tensor in eager.fisher.items():
        assert fisher_shape(lazy.fisher, name) == tensor.shape
        assert lazy.fisher[name].dtype == torch.float32 and torch.equal(lazy.fisher[name], tensor)
    assert lazy.statistics() == eager.statistics()  # of the stored (bf16: rounded) values, streamed from the files


def test_flat_ranges_and_blocks_equal_slices_of_the_full_tensors(saved):
    eager, directory = saved
    lazy = FisherAnchor.from_pretrained(directory, lazy=True).fisher
    for name, full in eager.fisher.items():
        n = full.numel()
        for start, stop in [(0, n), (0, 0), (n // 3, n // 3 + 1), (1, n - 1), (n - 1, n)]:
            part = read_flat(lazy, name, start, stop)
            assert torch.equal(part, full.reshape(-1)[start:stop]), (name, start, stop)
            assert torch.equal(read_flat(eager.fisher, name, start, stop), part)
    conv = eager.fisher["model.conv.weight"]
    for offsets, lengths in [([1, 0, 0], [2, 4, 2]), ([0, 1, 1], [3, 2, 1]), ([2, 0, 0], [0, 4, 2])]:
        block = read_block(lazy, "model.conv.weight", offsets, lengths)
        expected = conv[tuple(slice(o, o + k) for o, k in zip(offsets, lengths, strict=True))]
        assert block.shape == expected.shape and torch.equal(block, expected)
        assert torch.equal(read_block(eager.fisher, "model.conv.weight", offsets, lengths), block)


def test_a_flat_range_reads_only_the_rows_that_hold_it(tmp_path):
    FisherAnchor({"w": torch.rand(100, 10)}, name="a").save_pretrained(tmp_path)
    lazy = FisherAnchor.from_pretrained(tmp_path, lazy=True).fisher
    lazy.read_flat("w", 35, 61)  # rows 3..6: 40 values for 26 asked
    assert lazy.bytes_read == 40 * 4
    lazy.read_block("w", [10, 2], [5, 3])
    assert lazy.bytes_read == (40 + 15) * 4
    lazy["w"]
    assert lazy.bytes_read == (40 + 15 + 1000) * 4


@pytest.mark.parametrize("bad, says", [(-1.0, "negative Fisher values"), (math.nan, "NaN/Inf")])
def test_values_are_checked_as_they_are_read(tmp_path, bad, says):
    make_anchor().save_pretrained(tmp_path)
    values = torch.ones(7, 5)
    values[5, 1] = bad
    tensors = {**{n: torch.ones(s) for n, s in SHAPES.items()}, "model.embed.weight": values}
    save_file(tensors, str(tmp_path / WEIGHTS_NAME))
    lazy = FisherAnchor.from_pretrained(tmp_path, lazy=True)  # headers only: nothing read yet
    assert torch.equal(lazy.fisher.read_flat("model.embed.weight", 0, 25), torch.ones(25))  # rows 0..4 are fine
    for read in (lambda f: f["model.embed.weight"], lambda f: f.read_flat("model.embed.weight", 26, 27)):
        with pytest.raises(AnchorValidationError, match=f"'math'.*'model.embed.weight'.*{says}"):
            read(lazy.fisher)
    with pytest.raises(AnchorValidationError, match=says):
        FisherAnchor.from_pretrained(tmp_path)  # the anchor in memory checks every value at load


def test_a_truncated_file_is_refused_when_the_lazy_anchor_is_loaded(tmp_path):
    make_anchor().save_pretrained(tmp_path)
    (tmp_path / WEIGHTS_NAME).write_bytes((tmp_path / WEIGHTS_NAME).read_bytes()[:-8])
    with pytest.raises(AnchorFormatError, match="truncated or corrupt"):
        FisherAnchor.from_pretrained(tmp_path, lazy=True)


def test_the_free_threshold_streams_the_lazy_tensors_one_at_a_time(saved):
    eager, directory = saved
    lazy = FisherAnchor.from_pretrained(directory, lazy=True).fisher
    names = ["model.conv.weight", "scale", "model.norm.weight"]
    expected = float(torch.kthvalue(torch.cat([eager.fisher[n].reshape(-1) for n in names]), 28).values)
    for name in names:
        lazy[name]
    one_pass = lazy.bytes_read
    assert free_threshold(TensorsOf(lazy, names), 0.9) == expected  # 31 values: k = ceil(27.9)
    assert lazy.bytes_read == 3 * one_pass  # two passes, each reading every named tensor once


def test_binding_a_lazy_anchor_gives_the_state_of_the_anchor_in_memory(tmp_path):
    model = tiny_llama()
    anchor_for(model).save_pretrained(tmp_path)
    eager, lazy = FisherAnchor.from_pretrained(tmp_path), FisherAnchor.from_pretrained(tmp_path, lazy=True)
    one, two = CFPState(model, eager), CFPState(model, lazy)
    assert one.names == two.names
    assert one.views["math"].threshold == two.views["math"].threshold  # the free-drift threshold
    assert all(torch.equal(a, b) for a, b in zip(one.views["math"].fisher, two.views["math"].fisher, strict=True))
