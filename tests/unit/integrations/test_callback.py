"""CFPCallback's arguments refused by name (lam, lam schedules, free_fraction, duplicate anchor
names), and an anchor of another base model refused at train begin (a warning with strict=False)."""

import pytest
from support.tiny import anchor_for, tiny_llama

from hf_cfp import CFPCallback
from hf_cfp.errors import AnchorMismatchError, CFPArgumentError


@pytest.mark.parametrize("lam", [-1.0, float("nan"), float("inf"), "1"])
def test_bad_lam_is_refused(lam):
    with pytest.raises(CFPArgumentError, match="lam must be"):
        CFPCallback(anchor_for(tiny_llama()), lam=lam)


def test_bad_lam_schedule_is_refused_at_its_step():
    callback = CFPCallback(anchor_for(tiny_llama()), lam=lambda step: 1.0 - step)
    assert callback.lam_at(1) == [0.0]
    with pytest.raises(CFPArgumentError, match="schedule"):
        callback.lam_at(2)


@pytest.mark.parametrize("fraction", [0.0, 1.0, 1.5, -0.1])
def test_free_fraction_outside_open_unit_interval_is_refused(fraction):
    with pytest.raises(CFPArgumentError, match="free_fraction"):
        CFPCallback(anchor_for(tiny_llama()), free_fraction=fraction)


def test_duplicate_anchor_names_are_refused():
    model = tiny_llama()
    with pytest.raises(CFPArgumentError, match="unique"):
        CFPCallback(anchor_for(model, "math"), monitor=[anchor_for(model, "math", seed=2)])


def test_an_anchor_of_another_base_model_is_refused_at_train_begin(caplog):
    from transformers import TrainerControl, TrainerState

    from hf_cfp import estimate_fisher

    base = tiny_llama(seed=0)
    anchor = estimate_fisher(base, None, [[1, 2, 3]], num_sequences=2, max_new_tokens=2, show_progress=False, name="m")
    assert anchor.metadata["base_fingerprint"]["num_parameters"] == sum(p.numel() for p in base.parameters())
    other = tiny_llama(seed=1)  # same architecture, other weights
    with pytest.raises(AnchorMismatchError, match="another base model.*different weights"):
        CFPCallback(anchor).on_train_begin(None, TrainerState(), TrainerControl(), model=other)
    lenient = CFPCallback(anchor, strict=False)
    lenient.on_train_begin(None, TrainerState(), TrainerControl(), model=other)
    assert "another base model" in caplog.text and lenient.protection.model is other
    CFPCallback(anchor).on_train_begin(None, TrainerState(), TrainerControl(), model=base)  # the right one binds
