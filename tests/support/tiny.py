"""Tiny models and a tiny tokenizer built in memory: nothing is downloaded."""

import torch

# the one tiny-model and tiny-tokenizer builders (demo, evidence, scripts, tests)
from hf_cfp.loading.models import tiny_llama, tiny_tokenizer

__all__ = ["accelerate_launch", "anchor_for", "free_port", "tiny_llama", "tiny_tokenizer", "torchrun"]


def anchor_for(model, name="math", seed=0):
    """A FisherAnchor of uniform random values over every parameter of `model`."""
    from hf_cfp import FisherAnchor

    g = torch.Generator().manual_seed(seed)
    return FisherAnchor(
        {n: torch.rand(p.shape, generator=g) for n, p in model.named_parameters()},
        name=name,
        metadata={"base_model": "org/base"},
    )


def free_port() -> int:
    """A TCP port free now on 127.0.0.1 (fixed ports collide with concurrent runs)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# torch's gloo teardown race (pytorch/pytorch#190489): DDP keeps its gloo process group alive past
# `destroy_process_group`, and a gloo worker thread that frees a finished collective's work while the interpreter
# shuts down aborts a process whose run had finished, with this message (docs/guides/distributed.md,
# scripts/probe_gloo_teardown.py).
GLOO_TEARDOWN_ABORT = "terminate called without an active exception"


def run_cpu_processes(command: list, timeout: int, env: dict | None):
    """Run a launcher `command` with one intra-op thread and no visible GPU (extra environment `env`);
    returns the CompletedProcess (stdout/stderr captured). A run that failed with torch's gloo teardown abort
    (`GLOO_TEARDOWN_ABORT`) is started once more, with a warning; any other failure is returned as it is."""
    import os
    import subprocess
    import warnings

    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **(env or {})}
    arguments = list(map(str, command))
    run = subprocess.run(arguments, env=env, capture_output=True, text=True, timeout=timeout)
    if run.returncode != 0 and GLOO_TEARDOWN_ABORT in run.stderr:
        launch = " ".join(arguments[1:])[:300]
        warnings.warn(f"torch's gloo teardown abort in `{launch}`; running it once more", stacklevel=3)
        run = subprocess.run(arguments, env=env, capture_output=True, text=True, timeout=timeout)
    return run


def torchrun(script, *args, nproc: int = 2, timeout: int = 300, env: dict | None = None):
    """Run `script` on `nproc` CPU processes with torch.distributed.run on a free port (extra
    environment `env`); returns the CompletedProcess (stdout/stderr captured)."""
    import sys

    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", nproc]
    command += ["--master_addr", "127.0.0.1", "--master_port", free_port(), script, *args]
    return run_cpu_processes(command, timeout, env)


def accelerate_launch(script, *args, config_file, launch_args=(), timeout: int = 300, env: dict | None = None):
    """Run `script` through the real `accelerate launch --config_file <config_file>` on a free port, on the
    CPU: `ACCELERATE_USE_CPU=true` makes a multi-GPU config start its processes as gloo DDP (without it each
    process runs alone). `launch_args`: more launcher options, which override the config file's."""
    import sys

    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config_file]
    command += ["--main_process_ip", "127.0.0.1", "--main_process_port", free_port(), *launch_args, script, *args]
    return run_cpu_processes(command, timeout, {"ACCELERATE_USE_CPU": "true", **(env or {})})
