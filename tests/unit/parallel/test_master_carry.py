"""ZeRO-1/2: a correction applied outside `MasterCorrection` (LoRA factors) is carried into the fp32 master copy.

DeepSpeed's `param._hp_mapping` is faked: `lp_fragment_address` (start, numel inside the flattened
parameter) and `get_hp_fragment()` (this process's fp32 master fragment of it).
"""

from types import SimpleNamespace

import torch

from hf_cfp.parallel.deepspeed import MasterCorrection


def mapped(values, dtype, start, numel, master_offset=0.0):
    """A parameter of `values` in `dtype` whose elements [start, start + numel) have an fp32 master fragment
    (its own values plus `master_offset`: the master's extra precision)."""
    param = torch.nn.Parameter(torch.tensor(values, dtype=dtype), requires_grad=True)
    hp = param.detach().float()[start : start + numel].clone() + master_offset
    param._hp_mapping = SimpleNamespace(
        lp_fragment_address=SimpleNamespace(start=start, numel=numel), get_hp_fragment=lambda: hp
    )
    return param, hp


def halve(*params):
    def correct():
        with torch.no_grad():
            for p in params:
                p.mul_(0.5)

    return correct


def test_fp32_fragments_become_the_corrected_values_and_bit16_ones_take_the_change():
    fp32, fp32_master = mapped([1.0, 3.0, 5.0, 7.0, 9.0], torch.float32, start=1, numel=3)
    bf16, bf16_master = mapped([2.0, 6.0, 10.0, 14.0], torch.bfloat16, start=0, numel=2, master_offset=1e-3)
    bf16_before, bf16_master_before = bf16.detach().float().clone(), bf16_master.clone()
    not_owned, _ = mapped([4.0, 8.0], torch.float32, start=0, numel=0)
    correction = MasterCorrection([], [], [], followed=[fp32, bf16, not_owned])
    assert correction.followed == [fp32, bf16]  # no fragment of `not_owned` here: nothing to carry

    correction.carry(halve(fp32, bf16, not_owned))

    assert torch.equal(fp32_master, torch.tensor([1.5, 2.5, 3.5]))  # = the corrected fp32 values, bitwise
    change = bf16.detach().float()[:2] - bf16_before[:2]  # (-1, -3): exact in bf16
    assert torch.equal(bf16_master, bf16_master_before + change)  # the master keeps its extra 1e-3
    assert torch.equal(bf16_master, torch.tensor([2.0, 6.0]) + 1e-3 + torch.tensor([-1.0, -3.0]))


def test_an_unchanged_bit16_factor_leaves_its_master_fragment_bitwise_alone():
    bf16, master = mapped([2.0, 6.0], torch.bfloat16, start=0, numel=2, master_offset=1e-3)
    before = master.clone()
    MasterCorrection([], [], [], followed=[bf16]).carry(lambda: None)
    assert torch.equal(master, before)
