"""The behavioural task measure: each prompt's pirate reward over its sampled and greedy completions, its gain over
the base model's on the same prompts and seed, checked against a plain loop over generate() and the lexicon."""

import math

import torch
from support.extras import needs

needs("trl", "datasets")

from evidence.rewards import PIRATE_WORDS, words  # noqa: E402
from evidence.run import tiny_model_and_tokenizer  # noqa: E402
from longrun.measure import behaviour_gains, pirate_scores  # noqa: E402

from hf_cfp.evaluation import greedy_answers  # noqa: E402


def _share(text: str) -> float:
    found = words(text)
    return sum(w in PIRATE_WORDS for w in found) / len(found) if found else 0.0


def test_the_greedy_column_scores_each_prompts_greedy_answer_and_the_sampled_ones_are_seeded():
    model, tokenizer = tiny_model_and_tokenizer()
    prompts = ["Tell me about the sea.", "What is a ship?", "Say hello."]
    scores = pirate_scores(model, tokenizer, prompts, 2, 6, seed=3)
    assert scores.shape == (3, 3) and scores.dtype == torch.float64
    greedy = greedy_answers(model, tokenizer, prompts, 6)
    expected = [_share(tokenizer.decode(ids, skip_special_tokens=True)) for ids in greedy]
    assert scores[:, -1].tolist() == expected
    assert torch.equal(pirate_scores(model, tokenizer, prompts, 2, 6, seed=3), scores)


def test_the_gain_is_the_mean_over_prompts_of_each_prompts_mean_minus_the_bases():
    model = torch.tensor([[0.5, 0.0, 1.0], [0.2, 0.4, 0.0], [0.0, 0.0, 0.3]], dtype=torch.float64)
    base = torch.tensor([[0.0, 0.0, 0.5], [0.1, 0.1, 0.1], [0.0, 0.0, 0.0]], dtype=torch.float64)
    row = behaviour_gains(model, base)
    per_prompt = [(sum(m) - sum(b)) / 3 for m, b in zip(model.tolist(), base.tolist(), strict=True)]
    mean = sum(per_prompt) / 3
    sd = math.sqrt(sum((g - mean) ** 2 for g in per_prompt) / 2)
    assert math.isclose(row["behaviour/pirate_gain"], mean, rel_tol=1e-12)
    assert math.isclose(row["behaviour/pirate_gain_stderr"], sd / math.sqrt(3), rel_tol=1e-12)
    assert math.isclose(row["behaviour/pirate_greedy_gain"], (0.5 - 0.1 + 0.3) / 3, rel_tol=1e-12)
    assert math.isclose(row["behaviour/pirate_sampled_gain"], (0.25 + 0.2 + 0.0) / 3, rel_tol=1e-12)
    assert math.isclose(row["behaviour/pirate_reward"], float(model.mean()), rel_tol=1e-12)
    assert row["behaviour/items"] == 3
