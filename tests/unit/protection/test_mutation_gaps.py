"""Gaps found by mutation testing (scripts/mutation_report.sh): mutants of the modules where a
wrong number is silent that changed a result and that no other in-process test noticed.

One file for all of them (a second `test_mutation_gaps.py` under tests/unit/ops/ would clash:
test files need unique basenames in pytest's default import mode). Sections:

- protection/checkpoint.py: theta0 saved by several processes (pieces [start, stop) in per-rank
  files, read back under another layout), files written before ranges were recorded (full
  tensors, 2-D included), and the exact error messages. The multi-process tests
  (tests/integration/test_distributed.py) run under torchrun; here `process_rank_and_count` is
  replaced so that one process plays each rank.
- protection/state.py, diagonal.py: drift metrics with sharded tensors, whose sums of squares are all-reduced
  in float64 (a stand-in all-reduce adds a second process's equal shard sums), and a monitor
  anchor that covers only frozen parameters.
- ops/drift.py: the free drift refuses lists of different lengths instead of truncating.
- fisher/per_sequence_grads.py (the batched engine's accumulation): an untied embedding alone
  (the sparse path) in several chunks and in a batch of one sequence, a scaled embedding with
  c = 2 exactly, and a weight with two dense uses in several chunks.
- fisher/scoring.py (the loop engine): a parameter the score does not depend on.

Expected values are written out by hand (small exact numbers) or come from plain loops over
sequences and positions in float64 (small integers, so float32 results are exact); none is
computed by the library.
"""

import dataclasses
import json
import math
import re
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

import hf_cfp.geometry.base as geometry_module
import hf_cfp.protection.checkpoint as checkpoint
import hf_cfp.protection.state as state_module
from hf_cfp import CFPError, FisherAnchor
from hf_cfp.fisher.per_sequence_grads import Use, accumulate
from hf_cfp.fisher.scoring import add_squared_score
from hf_cfp.geometry.binding import HeldRange
from hf_cfp.ops import DriftView, drift_squares
from hf_cfp.protection import CFPState, SavedTheta0, has_saved_theta0, save_theta0

# ---------------------------------------------------------------------------------------------
# checkpoint: save_theta0 / SavedTheta0
# ---------------------------------------------------------------------------------------------

W_FULL = torch.arange(12, dtype=torch.float32) * 0.5  # parameter "w", 12 elements, split 0..5 | 5..12
R_FULL = torch.tensor([7.0, 8.0, 9.0])  # parameter "r", replicated


def as_rank(monkeypatch, rank, count):
    monkeypatch.setattr(checkpoint, "process_rank_and_count", lambda: (rank, count))


def protection_of_rank(rank):
    """What save_theta0 reads from a CFPState: rank 0 holds w[0:5], rank 1 w[5:12]; both hold r.
    The replicated r comes first, so a rank > 0 must skip it and still write its w piece."""
    start, stop = (0, 5) if rank == 0 else (5, 12)
    return SimpleNamespace(
        tensors=[
            SimpleNamespace(name="r", theta0=R_FULL.clone(), held=HeldRange(0, 3, 3), sharded=False),
            SimpleNamespace(
                name="w", theta0=W_FULL[start:stop].clone(), held=HeldRange(start, stop, 12), sharded=True
            ),
        ],
        adapted=[],  # no LoRA-adapted weights (their snapshot: test_peft_adapters.py)
    )


def save_two_ranks(monkeypatch, directory):
    for rank in (0, 1):
        as_rank(monkeypatch, rank, 2)
        save_theta0(protection_of_rank(rank), directory)


def test_each_rank_writes_its_pieces_with_their_ranges(monkeypatch, tmp_path):
    save_two_ranks(monkeypatch, tmp_path)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["cfp_theta0-rank00000-of-00002.safetensors", "cfp_theta0-rank00001-of-00002.safetensors"]
    assert has_saved_theta0(tmp_path)
    with safe_open(str(tmp_path / files[0]), framework="pt") as rank0:
        assert rank0.metadata() == {"format": "pt", "cfp_ranges": json.dumps({"r": [0, 3, 3], "w": [0, 5, 12]})}
        assert torch.equal(rank0.get_tensor("r"), R_FULL)
        assert torch.equal(rank0.get_tensor("w"), torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0]))
    with safe_open(str(tmp_path / files[1]), framework="pt") as rank1:  # r is rank 0's to write
        assert rank1.metadata() == {"format": "pt", "cfp_ranges": json.dumps({"w": [5, 12, 12]})}
        assert sorted(rank1.keys()) == ["w"]
        assert torch.equal(rank1.get_tensor("w"), torch.tensor([2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 5.5]))


def test_a_rank_holding_only_replicated_parameters_writes_no_file(monkeypatch, tmp_path):
    as_rank(monkeypatch, 1, 2)
    replicated = SimpleNamespace(name="r", theta0=R_FULL, held=HeldRange(0, 3, 3), sharded=False)
    only_replicated = SimpleNamespace(tensors=[replicated], adapted=[])
    save_theta0(only_replicated, tmp_path)
    assert list(tmp_path.iterdir()) == []
    assert not has_saved_theta0(tmp_path)


@pytest.mark.parametrize(
    "held, expected",
    [
        (HeldRange(0, 12, 12), W_FULL),  # both pieces
        (HeldRange(3, 9, 12), torch.tensor([1.5, 2.0, 2.5, 3.0, 3.5, 4.0])),  # across the split at 5
        (HeldRange(5, 12, 12), torch.tensor([2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 5.5])),  # exactly rank 1's piece
        (HeldRange(1, 4, 12), torch.tensor([0.5, 1.0, 1.5])),  # inside rank 0's piece
        (HeldRange(11, 12, 12), torch.tensor([5.5])),  # the last element
    ],
)
def test_pieces_saved_by_two_ranks_are_read_under_another_layout(monkeypatch, tmp_path, held, expected):
    save_two_ranks(monkeypatch, tmp_path)
    read = SavedTheta0(tmp_path).read([("w", held), ("r", HeldRange(1, 3, 3))])
    assert read["w"].dtype == torch.float32
    assert torch.equal(read["w"], expected)
    assert torch.equal(read["r"], torch.tensor([8.0, 9.0]))


def test_read_is_float32_whatever_the_default_dtype(monkeypatch, tmp_path):
    save_two_ranks(monkeypatch, tmp_path)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        read = SavedTheta0(tmp_path).read([("w", HeldRange(3, 9, 12))])
    finally:
        torch.set_default_dtype(previous)
    assert read["w"].dtype == torch.float32


@pytest.mark.parametrize("metadata", [None, {"format": "pt"}])
def test_files_written_before_ranges_were_recorded_read_as_whole_parameters(tmp_path, metadata):
    """`cfp_theta0.safetensors` with full tensors (2-D ones are flattened row-major) and no ranges."""
    matrix = torch.arange(12, dtype=torch.float32).reshape(3, 4) + 100
    vector = torch.tensor([1.0, 2.0, 3.0, 4.0])
    save_file({"m": matrix, "v": vector}, tmp_path / "cfp_theta0.safetensors", metadata=metadata)
    saved = SavedTheta0(tmp_path)
    read = saved.read([("m", HeldRange(0, 12, 12)), ("v", HeldRange(0, 4, 4))])
    assert torch.equal(read["m"], torch.arange(12, dtype=torch.float32) + 100)
    assert torch.equal(read["v"], vector)
    part = saved.read([("m", HeldRange(2, 7, 12)), ("v", HeldRange(1, 3, 4))])
    assert torch.equal(part["m"], torch.tensor([102.0, 103.0, 104.0, 105.0, 106.0]))
    assert torch.equal(part["v"], torch.tensor([2.0, 3.0]))


def test_a_parameter_missing_from_the_files_is_named(monkeypatch, tmp_path):
    save_two_ranks(monkeypatch, tmp_path)
    expected = (
        f"The theta0 saved in {str(tmp_path)!r} does not cover parameter 'missing' (elements 0..2 of 2; "
        "0 found): resume with the anchors of the original run, from a checkpoint all of whose "
        "cfp_theta0-rank*.safetensors files were kept."
    )
    with pytest.raises(CFPError, match=f"^{re.escape(expected)}$"):
        SavedTheta0(tmp_path).read([("missing", HeldRange(0, 2, 2))])


def test_a_lost_rank_file_is_reported_with_the_elements_found(monkeypatch, tmp_path):
    as_rank(monkeypatch, 0, 2)
    save_theta0(protection_of_rank(0), tmp_path)  # rank 1's file never written
    expected = (
        f"The theta0 saved in {str(tmp_path)!r} does not cover parameter 'w' (elements 3..9 of 12; "
        "2 found): resume with the anchors of the original run, from a checkpoint all of whose "
        "cfp_theta0-rank*.safetensors files were kept."
    )
    with pytest.raises(CFPError, match=f"^{re.escape(expected)}$"):
        SavedTheta0(tmp_path).read([("w", HeldRange(3, 9, 12))])


def test_a_parameter_of_another_size_is_refused(monkeypatch, tmp_path):
    save_two_ranks(monkeypatch, tmp_path)
    expected = (
        f"The theta0 saved in {str(tmp_path)!r} has 12 elements for 'w', the model 10: resume with the "
        "model and anchors of the original run."
    )
    with pytest.raises(CFPError, match=f"^{re.escape(expected)}$"):
        SavedTheta0(tmp_path).read([("w", HeldRange(0, 10, 10))])


def test_no_saved_theta0_is_named(tmp_path):
    expected = f"No saved theta0 (cfp_theta0*.safetensors) in {str(tmp_path)!r}."
    with pytest.raises(CFPError, match=f"^{re.escape(expected)}$"):
        SavedTheta0(tmp_path)


def test_a_non_contiguous_shard_cannot_be_saved_or_restored(monkeypatch, tmp_path):
    as_rank(monkeypatch, 0, 2)
    piece = SimpleNamespace(name="w", theta0=W_FULL[:6], held=HeldRange(None, None, 12), sharded=True)
    split_later = SimpleNamespace(tensors=[piece], adapted=[])
    expected_save = (
        "Cannot save theta0 of 'w': this process's shard is not one contiguous run of the parameter's "
        "elements (a DTensor sharded on a dimension other than the first). Shard parameters on dim 0 "
        "(FSDP2's default) to checkpoint a protected run."
    )
    with pytest.raises(CFPError, match=f"^{re.escape(expected_save)}$"):
        save_theta0(split_later, tmp_path)
    save_two_ranks(monkeypatch, tmp_path)
    expected_read = "Cannot restore theta0 of 'w': this process's shard is not contiguous."
    with pytest.raises(CFPError, match=f"^{re.escape(expected_read)}$"):
        SavedTheta0(tmp_path).read([("w", HeldRange(None, None, 12))])


# ---------------------------------------------------------------------------------------------
# state: drift metrics over sharded tensors, and a monitor on frozen parameters only
# ---------------------------------------------------------------------------------------------


class ThreeParameters(nn.Module):
    def __init__(self, a, b, c):
        super().__init__()
        self.a = nn.Parameter(torch.zeros(a))
        self.b = nn.Parameter(torch.zeros(b))
        self.c = nn.Parameter(torch.zeros(c))


def state_with_deltas(monkeypatch, deltas, sharded):
    """CFPState over parameters a, b, c with F = 1 everywhere, theta0 = 0, theta = `deltas`, and the
    given parameters marked sharded (as FSDP would bind them)."""
    model = ThreeParameters(*(len(d) for d in deltas))
    anchor = FisherAnchor({n: torch.ones(len(d)) for n, d in zip("abc", deltas, strict=True)}, name="m")
    bind = state_module.bind_anchor

    def bind_marked(*args, **kwargs):
        bound = bind(*args, **kwargs)
        return [dataclasses.replace(t, sharded=s) for t, s in zip(bound, sharded, strict=True)]

    monkeypatch.setattr(state_module, "bind_anchor", bind_marked)
    state = CFPState(model, anchor)
    with torch.no_grad():
        for p, d in zip((model.a, model.b, model.c), deltas, strict=True):
            p.copy_(torch.tensor(d))
    return state


def all_drifts_equal(value):
    """The metrics of anchor "m" when every drift is `value` (F = 1, every coordinate free), never corrected."""
    return {
        "cfp/m/sensitive_drift": value,
        "cfp/m/free_drift": value,
        "cfp/total_drift": value,
        "cfp/m/predicted_kl": value**2 / 2,
        "cfp/m/lam": 0.0,
    }


def second_process_with_equal_shards(monkeypatch):
    """An all-reduce over 2 processes whose sharded sums of squares equal this one's: doubles them."""
    calls = []

    def all_reduce(tensors):
        (sums,) = tensors
        calls.append(sums.dtype)
        sums.mul_(2)

    monkeypatch.setattr(geometry_module, "all_reduce_sum_", all_reduce)  # the one collective of CFPState
    return calls


def test_replicated_sums_count_once_and_shard_sums_are_all_reduced(monkeypatch):
    calls = second_process_with_equal_shards(monkeypatch)
    # a replicated (sum of squares 1), b and c sharded (4 + 4 = 8 here, 8 on the other process);
    # every tensor's norm is exact in float32
    state = state_with_deltas(monkeypatch, [[1.0], [0.0, 2.0], [2.0]], sharded=[False, True, True])
    metrics = state.drift_metrics()
    assert calls == [torch.float64]
    expected = math.sqrt(1 + 2 * 8)  # 17; swapping replicated and sharded would give 2 * 1 + 8 = 10
    assert metrics == all_drifts_equal(expected)


def test_shard_sums_are_added_in_float64(monkeypatch):
    """Sums of squares 2^24 + 2^24 + 1 per process: exact in float64, 2^25 once rounded to float32."""
    second_process_with_equal_shards(monkeypatch)
    state = state_with_deltas(monkeypatch, [[4096.0], [4096.0], [1.0]], sharded=[True, True, True])
    metrics = state.drift_metrics()
    expected = math.sqrt(2 * (2**25 + 1))
    assert metrics == all_drifts_equal(expected)


def test_budget_lams_count_replicated_sums_once_and_all_reduce_shard_sums(monkeypatch):
    """F = 1 everywhere, so KL(lam) = K0 / (1 + lam)^2 with K0 = 0.5 (S_replicated + 2 S_shard) when a second
    process holds equal shards: the solved lam lies between the roots of KL = B and KL = 0.99 B."""
    calls = second_process_with_equal_shards(monkeypatch)
    state = state_with_deltas(monkeypatch, [[1.0], [0.0, 2.0], [2.0]], sharded=[False, True, True])
    k0 = 0.5 * (1 + 2 * 8)
    budget = k0 / 9  # lam* = 2
    (lam,) = state.budget_lams([budget])
    assert calls and set(calls) == {torch.float64}
    assert math.sqrt(k0 / budget) - 1 - 1e-9 <= lam <= math.sqrt(k0 / (0.99 * budget)) - 1 + 1e-9, lam


def test_a_monitor_covering_only_frozen_parameters_measures_zero():
    """LoRA-style: the monitor's parameters are all frozen, so it binds nothing (threshold inf)."""
    model = ThreeParameters(2, 2, 1)
    model.b.requires_grad_(False)
    protect = FisherAnchor({"a": torch.ones(2)}, name="protect")
    frozen = FisherAnchor({"b": torch.tensor([1.0, 3.0])}, name="frozen")
    state = CFPState(model, protect, monitors=[frozen])
    with torch.no_grad():
        model.a.copy_(torch.tensor([3.0, 4.0]))
    metrics = state.drift_metrics()
    assert metrics["cfp/frozen/sensitive_drift"] == 0.0
    assert metrics["cfp/frozen/free_drift"] == 0.0
    assert metrics["cfp/protect/sensitive_drift"] == 5.0
    assert metrics["cfp/total_drift"] == 5.0


# ---------------------------------------------------------------------------------------------
# ops/drift.py
# ---------------------------------------------------------------------------------------------


def test_drift_squares_refuses_a_view_with_fewer_fishers_than_tensors():
    deltas = [torch.tensor([1.0, 2.0]), torch.tensor([3.0])]
    with pytest.raises(ValueError, match="one F"):  # would silently drop the 2nd tensor
        drift_squares(deltas, [None, None], [DriftView([torch.tensor([0.0, 0.0])], threshold=1.0)])


# ---------------------------------------------------------------------------------------------
# fisher/per_sequence_grads.py: accumulate
# ---------------------------------------------------------------------------------------------

VOCAB, HIDDEN = 5, 2
# 3 sequences of 4 positions; sequence 0 uses row 1 twice (summed before squaring), id 0 is padding.
IDS = torch.tensor([[1, 3, 1, 0], [2, 2, 4, 0], [3, 1, 0, 0]])
G = torch.tensor(
    [
        [[1.0, -2.0], [3.0, 1.0], [2.0, 2.0], [9.0, 9.0]],
        [[-1.0, 1.0], [2.0, 0.0], [1.0, 3.0], [9.0, 9.0]],
        [[4.0, -1.0], [1.0, 1.0], [9.0, 9.0], [9.0, 9.0]],
    ]
)


def embedding_reference(ids, g, scale=1.0, padding_idx=0):
    """sum_b G_b^2 with G_b[row] = scale * sum of g_{b,t} over the positions t holding that row."""
    acc = torch.zeros(VOCAB, HIDDEN, dtype=torch.float64)
    for b in range(ids.shape[0]):
        per_sequence = torch.zeros(VOCAB, HIDDEN, dtype=torch.float64)
        for t in range(ids.shape[1]):
            row = int(ids[b, t])
            if row != padding_idx:
                per_sequence[row] += scale * g[b, t].double()
        acc += per_sequence**2
    return acc.float()


class ScaledEmbedding(nn.Embedding):
    """y = 2 W[ids] (as Gemma scales by sqrt(hidden), here exactly 2)."""

    def forward(self, ids):
        return super().forward(ids) * 2.0


@pytest.mark.parametrize("chunk_sequences", [1, 2, 3])
def test_untied_embedding_in_chunks_of_sequences(chunk_sequences):
    module = nn.Embedding(VOCAB, HIDDEN, padding_idx=0)
    acc = torch.zeros(VOCAB, HIDDEN)
    per_sequence = IDS.shape[1] * HIDDEN  # elements of one sequence's sparse gradient (g[b])
    accumulate(acc, [Use("embedding", "weight", IDS, G, module)], 3, chunk_sequences * per_sequence)
    assert torch.equal(acc, embedding_reference(IDS, G))


def test_untied_embedding_with_a_batch_of_one_sequence():
    module = nn.Embedding(VOCAB, HIDDEN, padding_idx=0)
    acc = torch.ones(VOCAB, HIDDEN)  # accumulates onto what is there
    accumulate(acc, [Use("embedding", "weight", IDS[:1], G[:1], module)], 1, 10**6)
    assert torch.equal(acc, 1 + embedding_reference(IDS[:1], G[:1]))


def test_embedding_scaled_by_exactly_two():
    module = ScaledEmbedding(VOCAB, HIDDEN, padding_idx=0)
    acc = torch.zeros(VOCAB, HIDDEN)
    accumulate(acc, [Use("embedding", "weight", IDS, G, module)], 3, 10**6)
    assert torch.equal(acc, embedding_reference(IDS, G, scale=2.0))
    assert torch.equal(acc, 4 * embedding_reference(IDS, G))


def test_a_weight_with_two_dense_uses_in_chunks_of_one_sequence():
    """A Linear weight used by two calls: G_b = sum_t g1 a1^T + sum_t g2 a2^T, summed before squaring."""
    generator = torch.Generator().manual_seed(0)
    batch, positions, d_in, d_out = 3, 2, 3, 2
    x1, x2 = (torch.randint(-2, 3, (batch, positions, d_in), generator=generator).float() for _ in range(2))
    g1, g2 = (torch.randint(-2, 3, (batch, positions, d_out), generator=generator).float() for _ in range(2))
    module = nn.Linear(d_in, d_out)
    uses = [Use("linear", "weight", x1, g1, module), Use("linear", "weight", x2, g2, module)]
    expected = torch.zeros(d_out, d_in, dtype=torch.float64)
    for b in range(batch):
        grad = torch.zeros(d_out, d_in, dtype=torch.float64)
        for t in range(positions):
            grad += torch.outer(g1[b, t].double(), x1[b, t].double())
            grad += torch.outer(g2[b, t].double(), x2[b, t].double())
        expected += grad**2
    for max_chunk_elements in (d_out * d_in, 10**6):  # one sequence per chunk, then all at once
        acc = torch.zeros(d_out, d_in)
        accumulate(acc, uses, batch, max_chunk_elements)
        assert torch.equal(acc, expected.float())


# ---------------------------------------------------------------------------------------------
# fisher/scoring.py: add_squared_score
# ---------------------------------------------------------------------------------------------


def test_a_parameter_the_score_does_not_depend_on_keeps_its_accumulator():
    used = nn.Parameter(torch.tensor([1.0, 2.0]))
    unused = nn.Parameter(torch.tensor([3.0]))  # e.g. a head outside the language-model path
    log_prob = (used * torch.tensor([3.0, -1.0])).sum()  # d/d used = (3, -1)
    accumulators = [torch.tensor([1.0, 1.0]), torch.tensor([0.5])]
    add_squared_score(accumulators, [used, unused], log_prob)
    assert torch.equal(accumulators[0], torch.tensor([10.0, 2.0]))
    assert torch.equal(accumulators[1], torch.tensor([0.5]))
    assert used.grad is None and unused.grad is None
