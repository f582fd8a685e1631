"""Prompts and pairs from bundled sets (`data/*.jsonl`) or the user's files: three capabilities and the demo's
off-capability task (torch-free: `hf-cfp --help` reads `CALIBRATION_SETS`).

Per capability in `CALIBRATION_SETS`, 32 calibration prompts (`<name>.jsonl`) and 24 held-out items
with reference answers (`<name>_eval.jsonl`), disjoint from the calibration prompts:

    math    arithmetic and word problems, answers integers;
    code    the 56 shortest HumanEval problems (MIT, see data/HumanEval-LICENSE.txt; made by
            scripts/make_code_data.py), answers the canonical solutions (function bodies);
    safety  harmful-intent requests a safe assistant refuses, answers short reference refusals.

The off-capability task: pirate-style SFT pairs (`pirate_style.jsonl`) and, for DPO, the same prompts
with the pirate response chosen over a plain one (`pirate_preferences.jsonl`).
"""

import json
import os
from importlib import resources
from typing import cast

from ..errors import CFPArgumentError

CALIBRATION_SETS = ("math", "code", "safety")


def _read_jsonl(filename: str) -> list[dict]:
    text = resources.files(__package__).joinpath(f"data/{filename}").read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _check_capability(name: str, what: str) -> None:
    if name not in CALIBRATION_SETS:
        raise CFPArgumentError(f"No bundled {what} set {name!r}; available: {CALIBRATION_SETS}.")


def calibration_prompts(name: str = "math") -> list[str]:
    """Bundled calibration prompts of one capability (strings, for the chat template)."""
    _check_capability(name, "calibration")
    return [row["prompt"] for row in _read_jsonl(f"{name}.jsonl")]


def eval_items(name: str = "math") -> list[tuple[str, object]]:
    """Held-out (prompt, reference answer) items of one capability, disjoint from its calibration prompts.

    Answers: "math" an int (for `greedy_exact_match`), "code" the canonical solution that completes the
    function in the prompt, "safety" a reference refusal (the prompts alone are for `refusal_rate`);
    each is a reference for `reference_log_likelihood`.
    """
    _check_capability(name, "evaluation")
    convert = int if name == "math" else str
    return [(row["prompt"], convert(row["answer"])) for row in _read_jsonl(f"{name}_eval.jsonl")]


def math_eval_items() -> list[tuple[str, int]]:
    """`eval_items("math")`: held-out math problems with integer answers (prompt, answer), for
    `reference_log_likelihood`, `greedy_exact_match` and the capability KL."""
    return cast(list[tuple[str, int]], eval_items("math"))


def pirate_style_pairs() -> list[tuple[str, str]]:
    """(prompt, response) pairs teaching a pirate speaking style: the demo's off-capability SFT task."""
    return [(row["prompt"], row["response"]) for row in _read_jsonl("pirate_style.jsonl")]


def load_pairs(source: str = "pirate_style") -> list[tuple[str, str]]:
    """(prompt, response) SFT pairs: the bundled "pirate_style" set (`pirate_style_pairs`) or a `.jsonl` file with
    "prompt" and "response" (or TRL's "completion") text fields per line."""
    if source == "pirate_style":
        return pirate_style_pairs()
    if not os.path.isfile(source) or not source.endswith(".jsonl"):
        raise CFPArgumentError(f"{source!r} is neither the bundled 'pirate_style' set nor a .jsonl file.")
    pairs = []
    with open(source, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            row = _json_line(source, number, line)
            prompt, response = row.get("prompt"), row.get("response", row.get("completion"))
            if not isinstance(prompt, str) or not isinstance(response, str):
                raise CFPArgumentError(
                    f"{source}, line {number}: give text fields 'prompt' and 'response' (or 'completion')."
                )
            pairs.append((prompt, response))
    if not pairs:
        raise CFPArgumentError(f"{source} holds no (prompt, response) pairs.")
    return pairs


def pirate_preference_triples() -> list[tuple[str, str, str]]:
    """(prompt, chosen, rejected) for DPO on the off-capability task: the prompts and pirate responses
    of `pirate_style_pairs` chosen, a plain answer of similar length rejected."""
    return [(row["prompt"], row["chosen"], row["rejected"]) for row in _read_jsonl("pirate_preferences.jsonl")]


def load_prompts(source: str) -> list:
    """Prompts from a bundled set name (one of `CALIBRATION_SETS`) or a file: `.jsonl` with a "prompt" field
    per line, `.json` holding a list, or plain text with one prompt per line.

    Raises:
        CFPArgumentError: no such set or file; a line or file that is not valid JSON, a .jsonl line without
            "prompt", a .json that is not a list, or no prompts at all (the message names the file and line).
    """
    if source in CALIBRATION_SETS:
        return calibration_prompts(source)
    if not os.path.isfile(source):
        raise CFPArgumentError(f"{source!r} is neither a bundled calibration set {CALIBRATION_SETS} nor a file.")
    with open(source, encoding="utf-8") as handle:
        text = handle.read()
    if source.endswith(".jsonl"):
        prompts = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                row = _json_line(source, number, line)
                if "prompt" not in row:
                    raise CFPArgumentError(f'{source}, line {number}: no "prompt" field; give one per line.')
                prompts.append(row["prompt"])
    elif source.endswith(".json"):
        try:
            prompts = json.loads(text)
        except json.JSONDecodeError as error:
            raise CFPArgumentError(f"{source}: not valid JSON ({error}); give a list of prompts.") from None
        if not isinstance(prompts, list):
            raise CFPArgumentError(f"{source} holds a JSON {type(prompts).__name__}; give a list of prompts.")
    else:
        prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise CFPArgumentError(f"{source} holds no prompts.")
    return prompts


def _json_line(source: str, number: int, line: str) -> dict:
    """Line `number` of the .jsonl file `source` as a dict (a JSON value that is not an object gives {}, a row
    without fields); CFPArgumentError naming the line when it is not JSON."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise CFPArgumentError(f"{source}, line {number}: not JSON ({error}).") from None
    return row if isinstance(row, dict) else {}
