"""The RL arms' rewards against their closed forms on hand-made completions (strings and chat messages, as TRL
passes them), and the sampled reward of a model against the same completions drawn by `draw_base_responses`
(the same sampler and random streams) and scored here one by one."""

import pytest
from support.extras import needs

needs("trl", "datasets")

from evidence.rewards import PIRATE_WORDS, REWARDS, brevity, pirate, sampled_rewards, words  # noqa: E402
from evidence.run import tiny_model_and_tokenizer  # noqa: E402

from hf_cfp.evaluation import draw_base_responses  # noqa: E402
from hf_cfp.loading.prompts import pirate_style_pairs  # noqa: E402


def test_words_are_lower_case_letter_runs_with_inner_apostrophes():
    assert words("Arr, the CAP'N be sailin' 2 seas!") == ["arr", "the", "cap'n", "be", "sailin", "seas"]
    assert words("42 + 7 = ?") == []


def test_pirate_reward_is_the_share_of_lexicon_words():
    completions = [
        "Arr, the sea be wide, matey!",  # arr, sea, be, matey of arr the sea be wide matey: 4 / 6
        "The answer is 12.",  # none of 3
        "",  # no words: 0
        "Ahoy ahoy ahoy",  # 3 / 3
        "Yer cap'n sails at dawn",  # yer, cap'n, sails of 5: 3 / 5
    ]
    assert pirate(completions) == [4 / 6, 0.0, 0.0, 1.0, 3 / 5]
    assert {"arr", "sea", "be", "matey", "ahoy", "yer", "cap'n", "sails"} <= PIRATE_WORDS
    assert not {"the", "wide", "answer", "is", "at", "dawn"} & PIRATE_WORDS


def test_rewards_read_chat_completions_as_their_text():
    chat = [[{"role": "assistant", "content": "Arr, the sea"}], [{"role": "assistant", "content": "abc"}]]
    assert pirate(chat) == [2 / 3, 0.0]
    assert brevity(chat) == [-12 / 100, -3 / 100]  # minus the length in characters / 100
    assert set(REWARDS) == {"pirate", "brevity"}


@pytest.fixture(scope="module")
def tiny():
    return tiny_model_and_tokenizer()


def test_sampled_rewards_are_the_mean_rewards_of_the_models_own_completions(tiny):
    model, tokenizer = tiny
    prompts = [p for p, _ in pirate_style_pairs()][:5]
    got = sampled_rewards(model, tokenizer, prompts, samples=2, max_new_tokens=6, seed=0)
    drawn = draw_base_responses(model, tokenizer, prompts, 2, 6, seed=0, batch_size=8)
    texts = [tokenizer.decode(r, skip_special_tokens=True) for r in drawn.responses]
    assert len(texts) == 10
    assert got["brevity"] == pytest.approx(sum(-len(t) / 100 for t in texts) / 10, rel=1e-12)
    expected = 0.0
    for text in texts:
        found = words(text)
        expected += sum(w in PIRATE_WORDS for w in found) / len(found) if found else 0.0
    assert got["pirate"] == pytest.approx(expected / 10, rel=1e-12, abs=1e-15)
    assert sampled_rewards(model, tokenizer, prompts, 2, 6, seed=0) == got  # seeded: the same completions
