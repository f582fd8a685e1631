"""Per-rank anchor loading on 2 CPU processes (gloo; tests/workers/per_rank_loading_worker.py): under FSDP2 and
FSDP1 each process reads from the anchor's files only the pieces of F it binds, and they equal the slices of the
full F; the free-drift threshold, streamed from the files, is the full F's on both processes. Loading + binding
lazily raises a process's peak resident memory by less than the whole anchor, which loading it whole exceeds (by
design it holds the shard of F plus the largest tensor, but a process's resident set also moves with its
allocator: one run measured 33 and 42 MiB on its two processes against a 42 MiB shard + largest tensor); the
figures are printed (run with -s)."""

import math

import pytest
import torch
from support.distributed import per_rank_model, run_worker
from support.tiny import anchor_for

from hf_cfp import FisherAnchor


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(the full F, the anchor's directory, the worker's per-rank results)."""
    directory = tmp_path_factory.mktemp("per-rank")
    anchor_for(per_rank_model()).save_pretrained(directory / "anchor")
    run = run_worker("per_rank_loading_worker.py", directory, directory / "anchor")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    ranks = [torch.load(directory / f"rank{r}.pt", weights_only=True) for r in range(2)]
    return FisherAnchor.from_pretrained(directory / "anchor").fisher, ranks


@pytest.mark.parametrize("layout", ["fsdp2", "fsdp1"])
def test_each_process_binds_and_reads_only_its_slices_of_f(saved, layout):
    full, ranks = saved
    covered = dict.fromkeys(full, 0)
    for rank in ranks:
        held = 0
        for name, start, stop, fisher in rank[layout]:
            assert torch.equal(fisher, full[name].reshape(-1)[start:stop]), (layout, name, start, stop)
            covered[name] += stop - start
            held += stop - start
        rows = sum(full[name][0].numel() for name, *_ in rank[layout] if full[name].dim() > 1)
        if layout == "fsdp2":  # whole rows (dim-0 shards): exactly the shard
            assert rank[f"{layout}_bytes_read"] == 4 * held
        else:  # flat pieces: at most the first and last rows' other elements besides
            assert 4 * held <= rank[f"{layout}_bytes_read"] <= 4 * (held + 2 * rows)
        assert held < 0.6 * sum(t.numel() for t in full.values())
    assert covered == {name: t.numel() for name, t in full.items()}  # the pieces add up to F, each once


def test_the_free_threshold_is_the_full_f_s_on_every_process(saved):
    full, ranks = saved
    flat = torch.cat([t.reshape(-1) for t in full.values()])
    expected = float(torch.kthvalue(flat, math.ceil(0.99 * flat.numel())).values)
    assert [r["lazy_threshold"] for r in ranks] == [expected, expected] == [r["eager_threshold"] for r in ranks]


def test_loading_and_binding_lazily_holds_less_than_the_whole_anchor(saved):
    full, ranks = saved
    size, largest = sum(t.numel() * 4 for t in full.values()), max(t.numel() * 4 for t in full.values())
    for r, rank in enumerate(ranks):
        shard = sum(4 * (stop - start) for _, start, stop, _ in rank["fsdp2"])
        assert rank["lazy_peak"] < size < rank["eager_peak"], (r, rank["lazy_peak"], shard + largest, size)
        print(
            f"rank {r}: anchor {size / 2**20:.1f} MiB; peak RSS rise loading + binding under FSDP2: lazily "
            f"{rank['lazy_peak'] / 2**20:.1f} MiB, whole {rank['eager_peak'] / 2**20:.1f} MiB"
        )
