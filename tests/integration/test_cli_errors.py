"""`hf-cfp` as a user runs it (a subprocess): a mistake gives two lines on stderr and exit code 2, a failure
exit code 1, never a traceback unless asked (`--debug`, HF_CFP_DEBUG=1); `--help` and `import hf_cfp.cli`
load no torch."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_cfp import FisherAnchor

ROOT = Path(__file__).resolve().parents[2]


def hf_cfp(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """`python -m hf_cfp.cli *args` in `cwd`, offline, with this checkout first on the path."""
    environment = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_CFP_DEBUG": "",
        **env,
    }
    command = [sys.executable, "-m", "hf_cfp.cli", *args]
    return subprocess.run(command, cwd=cwd, env=environment, capture_output=True, text=True, timeout=300)


def assert_short_error(result: subprocess.CompletedProcess, code: int, *phrases: str) -> None:
    assert result.returncode == code, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("hf-cfp") and ": error: " in lines[0]
    assert all(phrase in result.stderr for phrase in phrases), result.stderr
    assert result.stdout == ""


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A working directory with a saved anchor, a corrupt one, a file, and prompts that are not JSON."""
    root = tmp_path_factory.mktemp("cli-errors")
    FisherAnchor({"model.norm.weight": [1.0, 2.0]}, name="math").save_pretrained(root / "anchor")
    (root / "corrupt").mkdir()
    (root / "corrupt" / "cfp_config.json").write_text("{not json")
    (root / "a-file").write_text("x")
    (root / "prompts.json").write_text('["one", "two",')
    return root


CASES = {
    "inspect a missing directory": (["inspect", "./anchors/nope"], 2, ["nope"]),
    "estimate from a missing model": (["estimate", "--model", "./my-model", "--output", "x"], 2, ["--model"]),
    "estimate zero sequences": (["estimate", "--num-sequences", "0", "--output", "x"], 2, ["--num-sequences"]),
    "estimate top_p above 1": (["estimate", "--top-p", "1.5", "--output", "x"], 2, ["top_p", "(0, 1]"]),
    "estimate into a file": (["estimate", "--output", "a-file"], 2, ["--output", "is a file"]),
    "estimate from prompts not JSON": (
        ["estimate", "--prompts", "prompts.json", "--output", "x"],
        2,
        ["prompts.json", "not valid JSON"],
    ),
    "push a missing directory": (["push", "nope", "org/model"], 2, ["No anchor directory", "nope"]),
    "pull into a file": (["pull", "org/model", "--output", "a-file"], 2, ["--output", "is a file"]),
    "inspect a corrupt anchor": (["inspect", "./corrupt"], 1, ["not valid JSON", "re-save"]),
    "unknown command": (["train-it"], 2, ["invalid choice"]),
}


@pytest.mark.parametrize("case", CASES)
def test_a_mistake_gives_two_lines_and_its_exit_code(files, case):
    args, code, phrases = CASES[case]
    assert_short_error(hf_cfp(*args, cwd=files), code, *phrases)
    assert not (files / "x").exists()  # nothing written


@pytest.mark.parametrize("ask", ["flag", "environment"])
def test_debug_shows_the_traceback_with_the_same_exit_code(files, ask):
    args, env = (
        (["--debug", "inspect", "./corrupt"], {})
        if ask == "flag"
        else (["inspect", "./corrupt"], {"HF_CFP_DEBUG": "1"})
    )
    result = hf_cfp(*args, cwd=files, **env)
    assert result.returncode == 1
    assert "Traceback (most recent call last)" in result.stderr and "AnchorFormatError" in result.stderr
    assert result.stderr.strip().splitlines()[-2].startswith("hf-cfp inspect: error: ")


def test_debug_after_the_command_is_accepted(files):
    result = hf_cfp("inspect", "./anchor", "--debug", cwd=files)
    assert result.returncode == 0 and result.stdout.startswith("Anchor 'math': 2 coordinates\n")


def test_help_and_the_cli_import_load_no_torch(files):
    result = hf_cfp("--help", cwd=files)
    assert result.returncode == 0 and "inspect" in result.stdout and "Exit codes" in result.stdout
    script = (
        "import sys, hf_cfp, hf_cfp.cli, hf_cfp.cli.parser;"
        "hf_cfp.cli.parser.build_parser().parse_args(['inspect', 'x']);"
        "print(json.dumps(sorted(m for m in ('torch', 'transformers', 'accelerate', 'trl') if m in sys.modules)))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", "import json;" + script],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert json.loads(loaded.stdout) == []
