"""Sampling passes the KV cache under the name the model's forward takes: `cache` in transformers 5, also
through a PeftModel (whose forward takes **kwargs), so no `past_key_values` deprecation warning is raised."""

import logging
import warnings

from support.extras import needs
from support.tiny import tiny_llama

from hf_cfp.fisher.sampling import Sampler, batch_generator, kv_cache_argument, sample_responses

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
    assert kv_cache_argument(base) == kv_cache_argument(peft_model) == "cache"
    # LoRA's B starts at zero, so the PeftModel is the base model: the same seed draws the same tokens
    assert drawn == sample_responses(base, PROMPTS, Sampler(), 6, set(), 0, batch_generator(0, 0))
    assert [len(r) for r in drawn] == [6, 6, 6]
