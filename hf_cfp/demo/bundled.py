"""Bundled data (`data/*.jsonl`): calibration prompts per capability, a held-out math evaluation set
(disjoint from the calibration prompts) and the demo's off-capability SFT pairs."""

import json
import os
from importlib import resources

from ..errors import CFPArgumentError

CALIBRATION_SETS = ("math",)


def _read_jsonl(filename: str) -> list[dict]:
    text = resources.files(__package__).joinpath(f"data/{filename}").read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def calibration_prompts(name: str = "math") -> list[str]:
    """Bundled calibration prompts of one capability (strings, for the chat template)."""
    if name not in CALIBRATION_SETS:
        raise CFPArgumentError(f"No bundled calibration set {name!r}; available: {CALIBRATION_SETS}.")
    return [row["prompt"] for row in _read_jsonl(f"{name}.jsonl")]


def math_eval_items() -> list[tuple[str, int]]:
    """Held-out math problems with integer answers (prompt, answer), disjoint from the math calibration
    prompts: for `reference_log_likelihood`, `greedy_exact_match` and the capability KL."""
    return [(row["prompt"], int(row["answer"])) for row in _read_jsonl("math_eval.jsonl")]


def pirate_style_pairs() -> list[tuple[str, str]]:
    """(prompt, response) pairs teaching a pirate speaking style: the demo's off-capability SFT task."""
    return [(row["prompt"], row["response"]) for row in _read_jsonl("pirate_style.jsonl")]


def load_prompts(source: str) -> list:
    """Prompts from a bundled set name (e.g. "math") or a file: `.jsonl` with a "prompt" field
    per line, `.json` holding a list, or plain text with one prompt per line."""
    if source in CALIBRATION_SETS:
        return calibration_prompts(source)
    if not os.path.isfile(source):
        raise CFPArgumentError(f"{source!r} is neither a bundled calibration set {CALIBRATION_SETS} nor a file.")
    with open(source, encoding="utf-8") as handle:
        text = handle.read()
    if source.endswith(".jsonl"):
        return [json.loads(line)["prompt"] for line in text.splitlines() if line.strip()]
    if source.endswith(".json"):
        return list(json.loads(text))
    return [line for line in text.splitlines() if line.strip()]
