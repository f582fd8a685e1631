"""What a type checker sees of the options: mypy, run on a user's code, accepts calls of `CFPCallback`, `CFP` and
`CFPConfig` that pass their options, and reports a misspelled keyword, a value of the wrong type, another surface's
option and one positional argument too many (the signatures are written out in the source, not made at import)."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

import hf_cfp

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mypy") is None, reason="needs mypy (pip install 'hf-cfp[dev]')"
)

ROOT = Path(hf_cfp.__file__).resolve().parents[1]

# hf_cfp read from this checkout; every other package skipped (read as Any), so that mypy checks hf_cfp's own
# signatures in seconds instead of analysing torch and transformers
MYPY_CONFIG = f"""[mypy]
mypy_path = {ROOT}
follow_imports = skip
ignore_missing_imports = true

[mypy-hf_cfp.*]
follow_imports = silent
"""

PREAMBLE = """import torch

from hf_cfp import CFP, CFPCallback, FisherAnchor
from hf_cfp.launch import CFPConfig

anchor = FisherAnchor.from_pretrained("anchors/math")
model = torch.nn.Linear(2, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
"""

GOOD = """
CFPCallback(anchor, lam=10.0)
CFPCallback([anchor, "org/model:cfp/code"], [1.0, 10.0], monitor=["./anchors/safety"], strict=False)
CFPCallback(anchor, predicted_kl_budget=0.05, recheck_every=10, recheck_prompts=["2 + 2"], fisher_dtype="bfloat16")
CFPCallback(anchor, 300.0, kl_budget=1.0, kl_prompts=["What is 2 + 2?"], kl_every=8)
CFPCallback(anchor, lam=lambda step: min(1.0, step / 100), compute_if_missing=["a prompt"], estimate_kwargs={})
CFP(model, anchor, 300.0, optimizer=optimizer, scale_lam_with_lr=True, sparse=0.1, sparse_by="mass")
CFPConfig(cfp_anchor=["./anchors/math"], cfp_lam=[10.0], cfp_strict=False, cfp_recheck_every=5).build_callback()
"""

# each line: a wrong call, and the error code mypy must report on it
BAD = {
    "CFPCallback(anchor, lamda=1.0)": "call-arg",
    "CFP(model, anchor, lamda=1.0)": "call-arg",
    'CFPConfig(cfp_anchor=["./anchors/math"], cfp_lamda=[1.0])': "call-arg",
    'CFPCallback(anchor, free_fraction="most")': "arg-type",
    "CFPConfig(cfp_recheck_every=2.5)": "arg-type",
    "CFPCallback(anchor, optimizer=optimizer)": "call-arg",  # an option of CFP only
    "CFP(model, anchor, strict=False)": "call-arg",  # an option of CFPCallback and CFPConfig only
    "CFPCallback(anchor, 1.0, ())": "call-arg",  # too many positional arguments: monitor is keyword-only
}

REPORTED = re.compile(r"^(\w+)\.py:(\d+): error: .*\[([\w-]+)\]$")


def mypy_errors(tmp_path: Path, sources: dict[str, str]) -> set[tuple[str, int, str]]:
    """(file stem, line, error code) of every error mypy reports on `sources` (stem -> code)."""
    (tmp_path / "mypy.ini").write_text(MYPY_CONFIG)
    for stem, code in sources.items():
        (tmp_path / f"{stem}.py").write_text(code)
    command = [sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "--cache-dir", str(tmp_path / "cache")]
    done = subprocess.run(
        [*command, *(f"{stem}.py" for stem in sources)], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode in (0, 1), done.stdout + done.stderr  # 2: mypy itself failed
    return {(m[1], int(m[2]), m[3]) for line in done.stdout.splitlines() if (m := REPORTED.match(line))}


def test_mypy_accepts_the_options_and_reports_a_wrong_keyword_or_type(tmp_path):
    first = PREAMBLE.count("\n") + 1  # the line of BAD's first call in bad.py
    errors = mypy_errors(tmp_path, {"good": PREAMBLE + GOOD, "bad": PREAMBLE + "\n".join(BAD) + "\n"})
    assert {e for e in errors if e[0] == "good"} == set()
    expected = {("bad", first + i, code) for i, code in enumerate(BAD.values())}
    assert {e for e in errors if e[0] == "bad"} == expected
