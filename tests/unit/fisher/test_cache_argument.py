"""Sampling a PeftModel goes through its generate (which hands its arguments to the base model's) with no
`past_key_values` deprecation warning, and draws what the base model draws when LoRA's B is still zero."""

import logging
import warnings

from support.extras import needs
from support.tiny import tiny_llama

from hf_cfp.fisher.sampling import Sampler, batch_generator, sample_responses

PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]


def test_a_peft_model_samples_with_the_new_cache_argument_and_no_warning(caplog):
    needs("peft")
    from peft import LoraConfig, get_peft_model

    base = tiny_llama(vocab_size=12)
    peft_model = get_peft_model(tiny_llama(vocab_size=12), LoraConfig(r=2, target_modules=["q_proj"]))
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        drawn = sample_responses(peft_model, PROMPTS, Sampler(), 6, set(), 0, batch_generator(0, 0))
    said = [str(w.message) for w in caught] + [r.getMessage() for r in caplog.records]
    assert not [line for line in said if "past_key_values" in line], said
    # LoRA's B starts at zero, so the PeftModel is the base model: the same seed draws the same tokens
    assert drawn == sample_responses(base, PROMPTS, Sampler(), 6, set(), 0, batch_generator(0, 0))
    assert [len(r) for r in drawn] == [6, 6, 6]
