"""Training layouts CFP cannot correct (DeepSpeed without a ZeRO optimizer at hand) are refused at
train begin with a clear error; a plain model binds."""

import pytest
from support.tiny import anchor_for, tiny_llama

from hf_cfp import CFPCallback


def test_deepspeed_and_fsdp1_are_refused_with_a_clear_error(monkeypatch):
    from types import SimpleNamespace

    from transformers import TrainerControl, TrainerState

    from hf_cfp import CFPError

    model = tiny_llama()
    callback = CFPCallback(anchor_for(model))
    with pytest.raises(CFPError, match="DeepSpeed but its `optimizer` argument is not a ZeRO"):
        callback.on_train_begin(
            SimpleNamespace(deepspeed="ds_config.json"), TrainerState(), TrainerControl(), model=model
        )
    monkeypatch.setattr(model.model.norm.weight, "ds_id", 3, raising=False)  # a ZeRO-3 partitioned parameter
    with pytest.raises(CFPError, match="DeepSpeed but its `optimizer` argument is not a ZeRO"):
        callback.on_train_begin(None, TrainerState(), TrainerControl(), model=model)
    monkeypatch.delattr(model.model.norm.weight, "ds_id")
    callback.on_train_begin(None, TrainerState(), TrainerControl(), model=model)  # a plain model binds
    assert callback.protection.model is model
