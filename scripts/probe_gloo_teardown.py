"""How often a finished two-process gloo DDP script aborts at interpreter shutdown, and whether its process group
outlives `destroy_process_group` (torch's teardown race, pytorch/pytorch#190489; tests/support/tiny.py starts a
launch that failed this way once more).

    python scripts/probe_gloo_teardown.py --runs 60           # the DDP model alive at exit, as a script's global
    python scripts/probe_gloo_teardown.py --runs 60 --free    # the model dropped and garbage collected first

Each run starts 2 CPU processes with `torch.distributed.run`; each wraps a small model in DDP, takes 4 SGD steps,
calls `destroy_process_group` (with `--free`, then drops the model and collects garbage), lists its surviving gloo
threads, and exits. Prints the runs whose processes aborted with "terminate called without an active exception"
and the gloo threads still alive at exit.
"""

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

DDP_SCRIPT = """
import gc, os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(4):
    model(torch.randn(8, 64)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
dist.destroy_process_group()
if os.environ["PROBE_FREE"] == "1":
    del model, optimizer
    gc.collect()
tasks = os.listdir("/proc/self/task")
names = sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in tasks)
sys.stdout.write(f"gloo threads at exit: {[n for n in names if 'gloo' in n]}\n")  # one write: ranks do not interleave
"""
ABORT = "terminate called without an active exception"


def run_once(script: Path, port: int, free: bool) -> subprocess.CompletedProcess:
    """One two-process launch of `script` on the CPU, one thread per process (`free`: PROBE_FREE=1)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    command += ["--master_addr", "127.0.0.1", "--master_port", str(port), str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PROBE_FREE": str(int(free))}
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=60)
    parser.add_argument("--port", type=int, default=29650, help="first port; run i uses port + i")
    parser.add_argument("--free", action="store_true", help="drop the DDP model and collect garbage before exit")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "ddp_exit.py"
        script.write_text(DDP_SCRIPT)
        aborted, threads = [], set()
        for i in range(args.runs):
            run = run_once(script, args.port + i, args.free)
            threads.update(line for line in run.stdout.splitlines() if line.startswith("gloo threads"))
            if run.returncode != 0:
                if ABORT not in run.stderr:
                    raise SystemExit(f"run {i} failed otherwise:\n{run.stderr[-3000:]}")
                aborted.append(i)
    print(f"aborted at shutdown: {len(aborted)} of {args.runs} runs {aborted}")
    print("\n".join(sorted(threads)))


if __name__ == "__main__":
    main()
