"""The reward functions `hf-cfp train grpo` offers by name, against values worked out by hand, and the lookup of
built-in names and dotted import paths."""

import pytest
from support.extras import needs

from hf_cfp.errors import CFPArgumentError
from hf_cfp.launch.rewards import brevity, last_number_matches, resolve_rewards


def test_last_number_matches_compares_the_last_number_with_the_answer():
    completions = [
        "17 + 25 = 42",  # last number 42
        "It is 41, or maybe 42.",  # last number 42, answer 41
        "no number at all",
        [{"role": "assistant", "content": "The total is 1,250."}],  # chat form; "1,250" is 1250
        "-3 degrees",
    ]
    assert last_number_matches(completions, answer=[42, 41, 3, "1250", -3]) == [1.0, 0.0, 0.0, 1.0, 1.0]
    with pytest.raises(CFPArgumentError, match="needs an 'answer' column"):
        last_number_matches(["1"])


def test_brevity_is_minus_the_length_over_100():
    completions = ["abc", "", [{"role": "assistant", "content": "x" * 250}]]
    assert brevity(completions) == [-0.03, 0.0, -2.5]


def test_rewards_by_name_by_import_path_and_a_reward_model_first():
    needs("trl")
    from trl.rewards import think_format_reward

    rewards = resolve_rewards(["brevity", "trl.rewards.think_format_reward"], reward_model="org/reward-model")
    assert rewards == ["org/reward-model", brevity, think_format_reward]
    assert resolve_rewards(["last_number_matches"]) == [last_number_matches]


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (["accuracy"], "reward_funcs: cannot load 'accuracy'"),
        (["trl.rewards.no_such_reward"], "reward_funcs: cannot load 'trl.rewards.no_such_reward'"),
        (["no_such_package.reward"], "reward_funcs: cannot load 'no_such_package.reward'"),
        (None, "hf-cfp train grpo needs a reward"),
    ],
)
def test_unknown_or_missing_rewards_are_errors(names, message):
    with pytest.raises(CFPArgumentError) as caught:
        resolve_rewards(names)
    assert message in str(caught.value)
