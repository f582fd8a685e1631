"""The RL arms' programmatic rewards (TRL reward functions: `f(completions, **kwargs) -> list[float]`), and the
task progress of an RL-trained model: its mean reward on the training prompts.

- `pirate`: the share of a completion's words that are in `PIRATE_WORDS`, |{w in words(c): w in L}| / |words(c)|
  (0 for a completion without words); words are the lower-cased runs of letters, inner apostrophes kept
  ("cap'n"). A style off every capability: nothing in math, code or refusals needs it.
- `brevity`: `hf_cfp.launch.rewards.brevity`, -len(c) / 100 (characters). It overlaps the capabilities: a shorter
  answer is a different math answer (or no answer), so protecting math must cost reward here.

`sampled_rewards` draws `samples` completions per prompt from a model (temperature 1, no truncation, at most
`max_new_tokens`, batch k from the stream `batch_generator(seed, k)` as `estimate_fisher` draws them) and returns
the mean of every reward; the task progress of an RL arm is that mean for the trained model minus the base
model's, on the same prompts, seed and counts (`measure.CapabilityProbe`).
"""

import re
from collections.abc import Callable
from typing import Any

import torch

from hf_cfp.fisher.sampling import Sampler, batch_generator, resolve_eos_ids, resolve_pad_id, sample_responses
from hf_cfp.fisher.token_ids import to_token_ids
from hf_cfp.launch.rewards import _text as completion_text
from hf_cfp.launch.rewards import brevity

PIRATE_WORDS = frozenset(
    # pirate speech (the SFT targets' "Arr, the sea be ...") and the sea-faring words it brings along
    "arr arrr ah ahoy avast aye be matey mateys me ye yer yo ho cap'n captain crew deck ship ships boat sail "
    "sails sailor sailors sailin sailing sea seas ocean oceans wave waves tide shore island storm wind treasure gold "
    "grog shanty anchor hearty booty plunder landlubber scallywag doubloons port starboard bow stern harbor "
    "harbour voyage adventure pirate pirates".split()
)
WORD = re.compile(r"[a-z]+(?:'[a-z]+)*")


def words(text: str) -> list[str]:
    """The lower-cased words of `text`: runs of letters a-z, apostrophes kept between letters."""
    return WORD.findall(text.lower())


def pirate(completions: list, **kwargs: Any) -> list[float]:
    """The share of each completion's words in `PIRATE_WORDS` (0 for a completion without words).

    Args:
        completions (`list`): the sampled completions (strings or chat messages).

    Returns:
        `list[float]`: one reward per completion, in [0, 1].
    """
    shares = []
    for completion in completions:
        found = words(completion_text(completion))
        shares.append(sum(w in PIRATE_WORDS for w in found) / len(found) if found else 0.0)
    return shares


REWARDS: dict[str, Callable[..., Any]] = {"pirate": pirate, "brevity": brevity}


@torch.no_grad()
def sampled_completions(
    model, tokenizer, prompts: list[str], samples: int, max_new_tokens: int, seed: int = 0
) -> list[str]:
    """`samples` completions per prompt (module docstring): prompt p's j-th completion is text p * samples + j,
    drawn in batches of 8, decoded without special tokens (the ending EOS dropped), as TRL hands completions to
    its reward functions."""
    prompt_ids = [ids for ids in to_token_ids(prompts, tokenizer) for _ in range(samples)]
    eos_ids = resolve_eos_ids(model, tokenizer)
    pad_id = resolve_pad_id(tokenizer, eos_ids)
    was_training = model.training
    model.eval()
    texts: list[str] = []
    try:
        for k, start in enumerate(range(0, len(prompt_ids), 8)):
            batch = prompt_ids[start : start + 8]
            drawn = sample_responses(
                model, batch, Sampler(1.0), max_new_tokens, eos_ids, pad_id, batch_generator(seed, k)
            )
            texts += tokenizer.batch_decode(drawn, skip_special_tokens=True)
    finally:
        model.train(was_training)
    return texts


def sampled_rewards(model, tokenizer, prompts: list[str], samples: int, max_new_tokens: int, seed: int = 0) -> dict:
    """{reward name: mean over prompts x samples completions} for every reward in `REWARDS`, of
    `sampled_completions`."""
    texts = sampled_completions(model, tokenizer, prompts, samples, max_new_tokens, seed)
    return {name: sum(reward(texts)) / len(texts) for name, reward in REWARDS.items()}
