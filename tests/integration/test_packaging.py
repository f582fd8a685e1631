"""The built wheel carries its package data: installed into a clean venv, it renders a model card.

The wheel is built from the repository without build isolation (no download), installed with
`--no-deps` into a new venv whose only other path is this environment's site-packages (for torch,
transformers, ...), so `import hf_cfp` there resolves to the wheel, not to the editable checkout.
"""

import json
import os
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

RENDER = """
import json, sys, torch, hf_cfp
from hf_cfp.anchor.card import render_card
anchor = hf_cfp.FisherAnchor({"w": torch.tensor([[1.0, 2.0], [3.0, 4.0]])}, name="math",
                             metadata={"base_model": "org/base", "num_sequences": 8})
card = render_card(anchor, "org/base:cfp/math")
print(json.dumps({"file": hf_cfp.__file__, "card": str(card)}))
"""


@pytest.fixture(scope="module")
def build(tmp_path_factory) -> tuple[Path, str]:
    """(the wheel, what the build printed: pip's and the build backend's output, not quieted)."""
    out = tmp_path_factory.mktemp("wheel")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(REPO)],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    (built,) = out.glob("hf_cfp-*.whl")
    return built, result.stdout + result.stderr


@pytest.fixture(scope="module")
def wheel(build) -> Path:
    return build[0]


def test_the_build_prints_no_warning(build):
    _, output = build
    assert "Successfully built hf-cfp" in output or "Saved " in output  # the output was captured
    assert "warning" not in output.lower(), output  # e.g. setuptools' deprecation of a TOML-table license
    archive = zipfile.ZipFile(build[0])
    (metadata,) = [name for name in archive.namelist() if name.endswith(".dist-info/METADATA")]
    assert "License-Expression: Apache-2.0" in archive.read(metadata).decode()


def test_wheel_contains_the_package_data(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "hf_cfp/anchor/templates/fisher_anchor.md" in names
    data = ["math", "math_eval", "code", "code_eval", "safety", "safety_eval", "pirate_style", "pirate_preferences"]
    assert {f"hf_cfp/loading/data/{name}.jsonl" for name in data} <= names
    assert "hf_cfp/loading/data/HumanEval-LICENSE.txt" in names  # the license of the code data travels with it
    assert not any(name.startswith("tests/") for name in names)


def test_wheel_in_a_clean_venv_renders_the_model_card(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    clean_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing but the venv's own paths
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-deps",
            "--ignore-installed",
            "-q",
            str(wheel),
        ],
        check=True,
        capture_output=True,
        timeout=300,
        env=clean_env,
    )
    result = subprocess.run(
        [python, "-c", RENDER], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=clean_env
    )
    assert result.returncode == 0, result.stderr[-2000:]
    shown = json.loads(result.stdout.strip().splitlines()[-1])
    assert Path(shown["file"]).is_relative_to(env_dir)  # the wheel, not the checkout
    card = shown["card"]
    assert "# CFP Fisher anchor: `math` for [org/base](https://huggingface.co/org/base)" in card
    assert "base_model: org/base" in card and "org/base:cfp/math" in card
    assert "Total mass 10, mean 2.5, 99th percentile 4, max 4." in card  # F = [[1, 2], [3, 4]]
