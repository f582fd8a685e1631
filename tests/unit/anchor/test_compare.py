"""compare_anchors and `hf-cfp compare`: top-set overlaps, cosine and module-type shares against hand-computed
values, an anchor against itself, ties at the k-th value, and clean errors."""

import math

import pytest
import torch
from support.tiny import anchor_for, tiny_llama

from hf_cfp import FisherAnchor
from hf_cfp.anchor.compare import compare_anchors
from hf_cfp.cli import main
from hf_cfp.errors import AnchorMismatchError
from hf_cfp.ops.order_statistics import top_mask

N = 2000  # top 0.1% = 2 coordinates, 1% = 20, 5% = 100
NAMES = {  # flat ranges: q_proj 0..999, down_proj 1000..1899, norm 1900..1999
    "model.layers.0.self_attn.q_proj.weight": (10, 100),
    "model.layers.0.mlp.down_proj.weight": (30, 30),
    "model.norm.weight": (100,),
}


def hand_made(flat, name):
    tensors, start = {}, 0
    for key, shape in NAMES.items():
        size = math.prod(shape)
        tensors[key] = flat[start : start + size].reshape(shape)
        start += size
    return FisherAnchor(tensors, name=name)


def ramp():
    return torch.arange(1, N + 1, dtype=torch.float32)  # a_i = i + 1: the top sets are the last indices


def ramp_with_last_dropped():
    flat = ramp()
    flat[N - 1] = 0.5  # a's largest coordinate becomes b's smallest
    return flat


S = N * (N + 1) * (2 * N + 1) // 6  # sum_i a_i^2 = 2,668,667,000
COSINE = (S - N**2 + N * 0.5) / math.sqrt(S * (S - N**2 + 0.25))  # <a, b> / (|a| |b|) for the two above
MASS = N * (N + 1) / 2
SHARES_A = {"q_proj": 1000 * 1001 / 2 / MASS, "down_proj": (1900 * 1901 - 1000 * 1001) / 2 / MASS}
SHARES_A["norm"] = 1 - SHARES_A["q_proj"] - SHARES_A["down_proj"]
MASS_B = MASS - N + 0.5
SHARES_B = {"q_proj": SHARES_A["q_proj"] * MASS / MASS_B, "down_proj": SHARES_A["down_proj"] * MASS / MASS_B}
SHARES_B["norm"] = 1 - SHARES_B["q_proj"] - SHARES_B["down_proj"]


def test_an_anchor_against_itself_overlaps_fully_with_cosine_exactly_one():
    anchor = anchor_for(tiny_llama())
    result = compare_anchors(anchor, anchor)
    assert result["top_overlap"] == {"0.1%": 1.0, "1%": 1.0, "5%": 1.0}
    assert result["cosine"] == 1.0
    assert all(row["share_a"] == row["share_b"] for row in result["module_types"])
    assert sum(row["share_a"] for row in result["module_types"]) == pytest.approx(1.0, rel=1e-12)


def test_hand_made_anchors_give_the_hand_computed_numbers():
    result = compare_anchors(hand_made(ramp(), "a"), hand_made(ramp_with_last_dropped(), "b"))
    # top 2 of a = {1998, 1999}, of b = {1997, 1998}; top 20 and top 100 lose index 1999 the same way
    assert result["top_overlap"] == {"0.1%": 1 / 2, "1%": 19 / 20, "5%": 99 / 100}
    assert result["cosine"] == pytest.approx(COSINE, rel=1e-12)
    assert result["num_parameters"] == N and (result["a"], result["b"]) == ("a", "b")
    rows = {row["type"]: (row["share_a"], row["share_b"]) for row in result["module_types"]}
    assert [row["type"] for row in result["module_types"]] == ["down_proj", "q_proj", "norm"]
    for kind in rows:
        assert rows[kind] == pytest.approx((SHARES_A[kind], SHARES_B[kind]), rel=1e-12)


def test_ties_at_the_kth_value_go_to_the_lower_index():
    ones = hand_made(torch.ones(N), "ones")  # every coordinate tied: T = the first k indices
    assert top_mask(list(ones.fisher.values()), 0.01).nonzero().squeeze(1).tolist() == list(range(20))
    flat = torch.zeros(N)
    flat[[5, 700, 1500]] = 2.0
    flat[[3, 9, 1999]] = 1.0  # top 0.1% (k = 2): two of the three 2.0s, the lower indices
    assert top_mask([flat], 0.001).nonzero().squeeze(1).tolist() == [5, 700]
    result = compare_anchors(ones, hand_made(ramp(), "a"))
    assert result["top_overlap"] == {"0.1%": 0.0, "1%": 0.0, "5%": 0.0}
    assert result["cosine"] == pytest.approx(MASS / math.sqrt(N * S), rel=1e-12)


def test_anchors_over_other_parameters_are_refused():
    a = hand_made(ramp(), "a")
    other = FisherAnchor({**a.fisher, "model.norm.weight": torch.ones(99)}, name="other")
    with pytest.raises(
        AnchorMismatchError, match=r"'a' and 'other' cover different parameters: .*'model.norm.weight'"
    ):
        compare_anchors(a, other)


def test_cli_prints_the_numbers(tmp_path, capsys):
    hand_made(ramp(), "a").save_pretrained(tmp_path / "a")
    hand_made(ramp_with_last_dropped(), "b").save_pretrained(tmp_path / "b")
    main(["compare", str(tmp_path / "a"), str(tmp_path / "b")])
    out = capsys.readouterr().out
    assert f"A: {tmp_path / 'a'} (anchor 'a')" in out and "2,000 coordinates" in out
    rows = {
        " ".join(line.split()[:-1]): line.split()[-1] for line in out.splitlines() if line.startswith(("  top", "cos"))
    }
    assert rows == {"top 0.1%": "0.5000", "top 1%": "0.9500", "top 5%": "0.9900", "cosine(F_A, F_B)": f"{COSINE:.6f}"}
    shares = {
        line.split()[0]: line.split()[1:]
        for line in out.splitlines()
        if line.split()[:1] in (["q_proj"], ["down_proj"], ["norm"])
    }
    assert shares == {kind: [f"{SHARES_A[kind]:.2%}", f"{SHARES_B[kind]:.2%}"] for kind in SHARES_A}


def test_cli_bad_path_or_mismatch_is_a_clean_error(tmp_path, capsys):
    hand_made(ramp(), "a").save_pretrained(tmp_path / "a")
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", str(tmp_path / "a"), str(tmp_path / "missing")])
    assert exit_info.value.code == 2  # missing input: a usage error
    err = capsys.readouterr().err
    assert err.startswith("hf-cfp compare: error: No anchor directory at") and "Traceback" not in err
    FisherAnchor({"w": torch.ones(3)}, name="w").save_pretrained(tmp_path / "w")
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", str(tmp_path / "a"), str(tmp_path / "w")])
    assert exit_info.value.code == 1  # a failure
    assert "cover different parameters" in capsys.readouterr().err
