"""Reward functions for `hf-cfp train grpo`, named by `reward_funcs` in the config: two built-in ones, or any
function by dotted import path (as `trl grpo` takes them)."""

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

from ..errors import CFPArgumentError
from ..evaluation.scores import final_number

RewardFunction = Callable[..., list[float]]


def _text(completion: Any) -> str:
    """A completion as text: GRPO passes strings, or `[{"role": "assistant", "content": ...}]` for chat prompts."""
    if isinstance(completion, str):
        return completion
    return "".join(str(message.get("content", "")) for message in completion)


def last_number_matches(completions: list, answer: list | None = None, **kwargs: Any) -> list[float]:
    """1.0 where the last number in the completion equals the last number of the dataset's `answer` column
    (`hf_cfp.evaluation.scores.final_number`: "1,250" is 1250), else 0.0. For the bundled math set
    `hf_cfp/loading/data/math_eval.jsonl` (integer answers).

    Args:
        completions (`list`): the sampled completions (strings or chat messages).
        answer (`list`): the `answer` column of the batch's rows.

    Returns:
        `list[float]`: one reward per completion.

    Raises:
        CFPArgumentError: the dataset has no `answer` column.
    """
    if answer is None:
        raise CFPArgumentError("reward last_number_matches needs an 'answer' column in the training dataset.")
    got = [final_number(_text(c)) for c in completions]
    return [float(g is not None and g == final_number(str(a))) for g, a in zip(got, answer, strict=True)]


def brevity(completions: list, **kwargs: Any) -> list[float]:
    """Minus the completion's length in characters / 100: shorter completions score higher (a reward any
    prompt-only dataset can train on).

    Args:
        completions (`list`): the sampled completions (strings or chat messages).

    Returns:
        `list[float]`: one reward per completion, -len(text) / 100.
    """
    return [-len(_text(c)) / 100 for c in completions]


BUILT_IN_REWARDS: dict[str, RewardFunction] = {"last_number_matches": last_number_matches, "brevity": brevity}


def resolve_rewards(names: list[str] | None, reward_model: str | None = None) -> list[Any]:
    """The reward functions (and reward model) for GRPOTrainer's `reward_funcs`.

    Args:
        names (`list[str]`): built-in names (`BUILT_IN_REWARDS`: `last_number_matches`, `brevity`) or dotted import
            paths `package.module.function` (e.g. `trl.rewards.think_format_reward`; the working directory is on
            the import path, as with `trl grpo`).
        reward_model (`str`, *optional*): a reward model id or directory, put first.

    Returns:
        `list`: what GRPOTrainer takes as `reward_funcs`.

    Raises:
        CFPArgumentError: no reward at all, or a name that is neither built in nor importable.
    """
    rewards: list[Any] = [reward_model] if reward_model else []
    for name in names or ():
        if name in BUILT_IN_REWARDS:
            rewards.append(BUILT_IN_REWARDS[name])
            continue
        module_name, _, attribute = name.rpartition(".")
        try:
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            rewards.append(getattr(importlib.import_module(module_name), attribute))
        except (ImportError, AttributeError, ValueError) as error:
            raise CFPArgumentError(
                f"reward_funcs: cannot load {name!r} ({error}); use one of {sorted(BUILT_IN_REWARDS)} or a dotted "
                "import path package.module.function."
            ) from None
    if not rewards:
        raise CFPArgumentError(
            f"hf-cfp train grpo needs a reward: reward_funcs (one of {sorted(BUILT_IN_REWARDS)} or a dotted import "
            "path) or reward_model_name_or_path."
        )
    return rewards
