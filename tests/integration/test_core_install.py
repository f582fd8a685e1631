"""The core install alone is enough for `CFPCallback` on a plain `transformers.Trainer`.

A fresh venv (no system site-packages) gets torch (pinned first, as scripts/setup.sh installs it, so pip never
resolves an unpinned torch) and then `pip install <this repository>` with no extra. There, trl, datasets and peft
cannot be imported, and a tiny Llama built from config trains 3 steps under `CFPCallback` with a hand-built
anchor: the logged drift equals a float64 recomputation from the weights, and no optional package was imported on
the way. Installing takes a minute or two (torch from the package index pip is configured with).
"""

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest
import torch

from hf_cfp.imports import EXTRA_OF

REPO = Path(__file__).resolve().parents[2]
TORCH = torch.__version__.split("+")[0]  # the version this suite runs on (2.13.0 in CI)

TRAIN = """
import importlib.util, json, math, sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
import hf_cfp
from hf_cfp import CFPCallback, FisherAnchor

optional = %(optional)r
installed = sorted(p for p in optional if importlib.util.find_spec(p) is not None)
torch.manual_seed(0)
config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=2, max_position_embeddings=64, bos_token_id=None, eos_token_id=None,
                     pad_token_id=None)
model = LlamaForCausalLM(config)
theta0 = {n: p.detach().double().clone() for n, p in model.named_parameters()}
g = torch.Generator().manual_seed(1)
fisher = {n: torch.rand(p.shape, generator=g) for n, p in model.named_parameters()}
anchor = FisherAnchor(fisher, name="math")
rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 32, (12, 10), generator=g)]
args = TrainingArguments(output_dir=sys.argv[1], max_steps=3, per_device_train_batch_size=4, learning_rate=3e-2,
                         use_cpu=True, report_to="none", logging_steps=1, save_strategy="no", seed=0,
                         disable_tqdm=True)
trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[CFPCallback(anchor, lam=1.0)])
trainer.train()
last = [h for h in trainer.state.log_history if "cfp/total_drift" in h][-1]
delta = {n: p.detach().double() - theta0[n] for n, p in model.named_parameters()}
sensitive = sum(float((fisher[n].double() * d * d).sum()) for n, d in delta.items())
print(json.dumps({
    "file": hf_cfp.__file__,
    "installed": installed,
    "imported": sorted(p for p in optional if p in sys.modules),
    "step": last["step"],
    "logged": {k: last[k] for k in ("cfp/math/sensitive_drift", "cfp/total_drift")},
    "reference": {
        "cfp/math/sensitive_drift": math.sqrt(sensitive),
        "cfp/total_drift": math.sqrt(sum(float((d * d).sum()) for d in delta.values())),
    },
    "config_has_cfp": hasattr(model.config, "cfp"),
}))
"""


def pip(python: Path, *args: str, env: dict) -> None:
    """This environment's pip, installing into the venv of `python` (`pip --python`), its output kept for errors."""
    result = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", *args],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]


@pytest.fixture(scope="module")
def core_venv(tmp_path_factory) -> tuple[Path, dict]:
    """(the python of a fresh venv holding torch and hf-cfp's core install, the environment to run it in)."""
    env_dir = tmp_path_factory.mktemp("core") / "venv"
    venv.EnvBuilder(with_pip=False, system_site_packages=False).create(env_dir)
    python = env_dir / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    pip(python, f"torch=={TORCH}", env=env)
    pip(python, str(REPO), env=env)  # no extra: the core dependencies only
    return python, env


def test_the_core_install_trains_with_cfp_and_imports_no_optional_package(core_venv, tmp_path):
    python, env = core_venv
    optional = sorted(EXTRA_OF)  # trl, datasets, peft, deepspeed, bitsandbytes, matplotlib, gguf
    script = TRAIN % {"optional": optional}
    result = subprocess.run(
        [python, "-c", script, str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,  # not the checkout: `import hf_cfp` must find the installed copy
        env={**env, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    shown = json.loads(result.stdout.strip().splitlines()[-1])
    assert Path(shown["file"]).is_relative_to(python.parent.parent)  # the venv's install, not the checkout
    assert shown["installed"] == []  # the core pulls no optional package: no trl, datasets, peft, ...
    assert shown["imported"] == []  # nor did training import any optional package
    assert shown["step"] == 3
    for key, reference in shown["reference"].items():
        assert shown["logged"][key] == pytest.approx(reference, rel=1e-5), key
    assert shown["logged"]["cfp/total_drift"] > 0  # the model moved
    assert shown["config_has_cfp"] is False
