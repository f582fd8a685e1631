"""hf_cfp.quiet: DeepSpeed's import-time note "Setting accelerator to CPU..." (printed to stdout whenever accelerate
or transformers import an installed deepspeed on a machine without a GPU) is dropped outside DeepSpeed runs, and
bitsandbytes' "Failed to load CPU gemm_4bit_forward from kernels-community" everywhere, and the CLI ignores the
FutureWarning TRL's DPO triggers in transformers; nothing else is silenced."""

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

import hf_cfp  # noqa: F401  (hf_cfp.quiet installs the filter on DeepSpeed's logger)

NOTE = "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."
ROOT = Path(__file__).resolve().parents[2]


def passes(message: str, logger: str = "DeepSpeed") -> bool:
    record = logging.LogRecord(logger, logging.WARNING, "real_accelerator.py", 213, message, None, None)
    return bool(logging.getLogger(logger).filter(record))


def test_only_the_cpu_note_is_dropped_and_only_outside_deepspeed_runs(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    assert not passes(NOTE)
    assert passes("Setting accelerator to cuda") and passes("ZeRO stage 3 initialized")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    assert passes(NOTE)


def test_the_bitsandbytes_kernels_note_is_dropped_and_nothing_else():
    bnb = "bitsandbytes.backends.cpu.ops"
    assert not passes("Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'.", bnb)
    assert passes("Some other bitsandbytes warning", bnb)
    assert passes("Failed to load CPU gemm_4bit_forward from kernels-community", "another.logger")


@pytest.mark.parametrize(
    ("prelude", "deepspeed_run", "printed"),
    [
        ("", False, 0),  # the filter at work
        ("import logging; logging.getLogger('DeepSpeed').filters.clear(); ", False, 1),  # the note without it
        ("", True, 1),  # a DeepSpeed run keeps it
    ],
)
def test_importing_deepspeed_after_hf_cfp_prints_no_note(prelude, deepspeed_run, printed):
    pytest.importorskip("deepspeed", reason="only matters where deepspeed is installed (the `deepspeed` extra)")
    env = {k: v for k, v in os.environ.items() if k not in ("DS_ACCELERATOR", "ACCELERATE_USE_DEEPSPEED")}
    env.update(
        CUDA_VISIBLE_DEVICES="",
        PYTHONPATH=str(ROOT),
        **({"ACCELERATE_USE_DEEPSPEED": "true"} if deepspeed_run else {}),
    )
    code = f"import hf_cfp; {prelude}import deepspeed"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count("Setting accelerator to CPU") == printed


def test_the_cli_ignores_the_known_future_warning_and_no_other():
    code = (
        "import warnings; from hf_cfp.quiet import silence_known_warnings; silence_known_warnings(); "
        "warnings.warn('`is_gradient_checkpointing` is deprecated and will be removed in v6.', FutureWarning); "
        "warnings.warn('`other_thing` is deprecated', FutureWarning)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "is_gradient_checkpointing" not in result.stderr and "`other_thing` is deprecated" in result.stderr
