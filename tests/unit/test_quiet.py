"""hf_cfp.quiet: while an `hf-cfp` command runs (`known_noise_silenced`, entered by `hf_cfp.cli.main`), DeepSpeed's
import-time note "Setting accelerator to CPU..." (printed to stdout whenever accelerate or transformers import an
installed deepspeed on a machine without a GPU) is dropped outside DeepSpeed runs, bitsandbytes' "Failed to load
CPU gemm_4bit_forward from kernels-community" everywhere, and the FutureWarning TRL's DPO triggers in transformers
is ignored; nothing else is silenced, and nothing at all outside a command: `import hf_cfp` leaves every logger
and warning filter as it was, and the command's filters come off when it ends."""

import json
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from hf_cfp.quiet import KNOWN_NOTES, known_noise_silenced

NOTE = "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."
ROOT = Path(__file__).resolve().parents[2]


def passes(message: str, logger: str = "DeepSpeed") -> bool:
    record = logging.LogRecord(logger, logging.WARNING, "real_accelerator.py", 213, message, None, None)
    return bool(logging.getLogger(logger).filter(record))


def test_only_the_cpu_note_is_dropped_and_only_outside_deepspeed_runs(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    with known_noise_silenced():
        assert not passes(NOTE)
        assert passes("Setting accelerator to cuda") and passes("ZeRO stage 3 initialized")
        monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
        assert passes(NOTE)


def test_the_bitsandbytes_kernels_note_is_dropped_and_nothing_else():
    bnb = "bitsandbytes.backends.cpu.ops"
    with known_noise_silenced():
        assert not passes(
            "Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'.", bnb
        )
        assert passes("Some other bitsandbytes warning", bnb)
        assert passes("Failed to load CPU gemm_4bit_forward from kernels-community", "another.logger")


def test_the_filters_come_off_when_the_command_ends_however_it_ends(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    before = {name: list(logging.getLogger(name).filters) for name in KNOWN_NOTES}
    warnings_before = list(warnings.filters)
    with pytest.raises(SystemExit), known_noise_silenced():
        assert not passes(NOTE)
        raise SystemExit(1)  # as `main` exits after a failed command
    assert passes(NOTE)
    assert {name: list(logging.getLogger(name).filters) for name in KNOWN_NOTES} == before
    assert warnings.filters == warnings_before


def test_importing_hf_cfp_touches_no_logger_and_no_warning_filter():
    """Every logger's filters, before and after importing hf_cfp and its public names (the libraries it uses
    imported first; what they import on the way may add loggers, without filters), and the warning filters with a
    message pattern (the kind hf_cfp's would be; a library imported on the way may add others by category)."""
    code = (
        "import json, logging, warnings\n"
        "def filters():\n"
        "    names = [''] + sorted(logging.root.manager.loggerDict)\n"
        "    return {n: [repr(f) for f in logging.getLogger(n).filters] for n in names}\n"
        "import torch, transformers, accelerate\n"
        "before, warned = filters(), list(warnings.filters)\n"
        "import hf_cfp, hf_cfp.cli\n"
        "from hf_cfp import CFPCallback, FisherAnchor, estimate_fisher\n"
        "from hf_cfp.loading import load_embedded_model\n"
        "after = filters()\n"
        "changed = {n: f for n, f in after.items() if f != before.get(n, [])}\n"
        "patterns = [str(f) for f in warnings.filters if f not in warned and f[1] is not None]\n"
        "print(json.dumps({'changed': changed, 'patterns': patterns}))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"changed": {}, "patterns": []}


@pytest.mark.parametrize(
    ("code", "deepspeed_run", "printed"),
    [
        ("with known_noise_silenced(): import deepspeed", False, 0),  # the filter at work, in a command
        ("import deepspeed", False, 1),  # outside a command: the library's own defaults
        ("with known_noise_silenced(): import deepspeed", True, 1),  # a DeepSpeed run keeps it
    ],
)
def test_importing_deepspeed_inside_a_command_prints_no_note(code, deepspeed_run, printed):
    pytest.importorskip("deepspeed", reason="only matters where deepspeed is installed (the `deepspeed` extra)")
    env = {k: v for k, v in os.environ.items() if k not in ("DS_ACCELERATOR", "ACCELERATE_USE_DEEPSPEED")}
    env.update(
        CUDA_VISIBLE_DEVICES="",
        PYTHONPATH=str(ROOT),
        **({"ACCELERATE_USE_DEEPSPEED": "true"} if deepspeed_run else {}),
    )
    script = f"import hf_cfp; from hf_cfp.quiet import known_noise_silenced\n{code}"
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count("Setting accelerator to CPU") == printed


def test_a_command_ignores_the_known_future_warning_and_no_other():
    code = (
        "import warnings; from hf_cfp.quiet import known_noise_silenced\n"
        "with known_noise_silenced():\n"
        "    warnings.warn('`is_gradient_checkpointing` is deprecated and will be removed in v6.', FutureWarning)\n"
        "    warnings.warn('`other_thing` is deprecated', FutureWarning)\n"
        "warnings.warn('`is_gradient_checkpointing` is deprecated (after the command)', FutureWarning)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "will be removed in v6" not in result.stderr and "`other_thing` is deprecated" in result.stderr
    assert "(after the command)" in result.stderr  # the filter is gone once the command ends


def test_the_cli_runs_its_command_inside_the_silenced_block(monkeypatch, tmp_path, capsys):
    """`hf_cfp.cli.main` enters `known_noise_silenced` around the command, and leaves it afterwards."""
    import hf_cfp.cli as cli
    from hf_cfp import FisherAnchor

    FisherAnchor({"w": [1.0, 2.0]}, name="math").save_pretrained(tmp_path / "anchor")
    seen = []
    real = cli.run_reporting_errors

    def spy(command, run, debug):
        seen.append(not passes(NOTE))  # inside: the note is dropped
        return real(command, run, debug)

    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    monkeypatch.setattr(cli, "run_reporting_errors", spy)
    cli.main(["inspect", str(tmp_path / "anchor")])
    assert seen == [True] and passes(NOTE)
    assert capsys.readouterr().out.startswith("Anchor 'math': 2 coordinates")
