"""Tiny models and a tiny tokenizer built in memory: nothing is downloaded."""

import torch

# the one tiny-model and tiny-tokenizer builders (demo, evidence, scripts, tests)
from hf_cfp.demo.models import tiny_llama, tiny_tokenizer

__all__ = ["anchor_for", "tiny_llama", "tiny_tokenizer", "torchrun"]


def anchor_for(model, name="math", seed=0):
    """A FisherAnchor of uniform random values over every parameter of `model`."""
    from hf_cfp import FisherAnchor

    g = torch.Generator().manual_seed(seed)
    return FisherAnchor(
        {n: torch.rand(p.shape, generator=g) for n, p in model.named_parameters()},
        name=name,
        metadata={"base_model": "org/base"},
    )


def torchrun(script, *args, nproc: int = 2, timeout: int = 300, env: dict | None = None):
    """Run `script` on `nproc` CPU processes with torch.distributed.run on a free port (extra
    environment `env`); returns the CompletedProcess (stdout/stderr captured)."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as probe:  # a free port now; fixed ports collide with concurrent runs
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **(env or {})}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    command += ["--master_addr", "127.0.0.1", "--master_port", str(port), str(script), *map(str, args)]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
