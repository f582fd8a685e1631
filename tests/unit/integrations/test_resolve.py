"""What CFPCallback accepts as an anchor: a directory, a Hub reference (the base-model check still
applies), or a Hub reference with nothing there yet, estimated at train begin and pushed
(`compute_if_missing`). The Hub is the local fake one (tests/support/hub_server.py)."""

import pytest
from support.anchors import same_anchor
from support.tiny import anchor_for, tiny_llama
from transformers import TrainerControl, TrainerState

from hf_cfp import CFPCallback, FisherAnchor, estimate_fisher
from hf_cfp.errors import AnchorMismatchError
from hf_cfp.geometry.diagonal.artifact import LazyFisher


def test_callback_accepts_a_directory_and_keeps_f_in_the_files(tmp_path):
    anchor_for(tiny_llama()).save_pretrained(tmp_path / "a")
    anchor = CFPCallback(str(tmp_path / "a")).anchor
    assert anchor.name == "math" and isinstance(anchor.fisher, LazyFisher)  # read per process as bound


def test_an_anchor_of_another_base_model_is_refused(local_hub):
    base = tiny_llama(seed=0)
    estimate_fisher(
        base, None, [[1, 2, 3]], num_sequences=2, max_new_tokens=2, name="math", show_progress=False
    ).push_to_hub("org/anchors")
    callback = CFPCallback("org/anchors:cfp/math")
    with pytest.raises(AnchorMismatchError, match="another base model"):
        callback.on_train_begin(None, TrainerState(), TrainerControl(), model=tiny_llama(seed=1))
    callback.on_train_begin(None, TrainerState(), TrainerControl(), model=base)
    assert callback.protection.model is base


def test_compute_if_missing_estimates_at_train_begin_and_pushes(local_hub):
    model = tiny_llama()
    callback = CFPCallback(
        "org/anchors:cfp/code",
        compute_if_missing=[[1, 2, 3], [4, 5]],
        push_if_computed=True,
        estimate_kwargs={"num_sequences": 4, "max_new_tokens": 3, "show_progress": False},
    )
    callback.on_train_begin(None, TrainerState(), TrainerControl(), model=model)
    assert callback.anchor.name == "code" and callback.anchor.metadata["num_sequences"] == 4
    assert same_anchor(FisherAnchor.from_pretrained("org/anchors:cfp/code"), callback.anchor)
