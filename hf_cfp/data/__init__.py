"""Bundled data: calibration prompts per capability and the demo's off-capability SFT pairs."""

import json
from importlib import resources

from ..errors import CFPArgumentError

CALIBRATION_SETS = ("math",)


def _read_jsonl(filename: str) -> list[dict]:
    text = resources.files(__name__).joinpath(filename).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def calibration_prompts(name: str = "math") -> list[str]:
    """Bundled calibration prompts of one capability (strings, for the chat template)."""
    if name not in CALIBRATION_SETS:
        raise CFPArgumentError(f"No bundled calibration set {name!r}; available: {CALIBRATION_SETS}.")
    return [row["prompt"] for row in _read_jsonl(f"{name}.jsonl")]


def pirate_style_pairs() -> list[tuple[str, str]]:
    """(prompt, response) pairs teaching a pirate speaking style: the demo's off-capability SFT task."""
    return [(row["prompt"], row["response"]) for row in _read_jsonl("pirate_style.jsonl")]
