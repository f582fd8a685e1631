"""Several processes sharing one long run's output directory (`long_run.py` started more than once on it): each
takes the next arm of the plan that no running process holds, so that two workers on one thread each train two
arms at once (on 2 cores more arms per hour than one worker on two threads: `scripts/bench_workers.py`).

An arm is held by a claim, `<run dir>/claim.json`, naming the process (boot id, pid, start time): a claim whose
process is gone (stopped with its session, or on a machine since replaced) is stale, and the next worker takes
the arm over, resuming from its last checkpoint. The shared files (`results.jsonl`, the anchors, the task and
the references made at the first start) are read and written under an exclusive lock on `<output_dir>/.lock`.
A WiSE-FT arm waits until its unregularized run has its row (it interpolates that run's final weights).
"""

import fcntl
import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from evidence.plan import Arm

CLAIM = "claim.json"


@contextmanager
def exclusive(out: Path) -> Iterator[None]:
    """Hold the lock on `<out>/.lock` while the block runs (other workers wait for it)."""
    with (out / ".lock").open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def process_id(pid: int | None = None) -> dict:
    """What names a process across PID reuse and machines: this boot's id, the pid and its start time (clock
    ticks since boot, field 22 of `/proc/<pid>/stat`); None fields when the process is gone."""
    pid = os.getpid() if pid is None else pid
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return {"boot": None, "pid": pid, "start": None}
    start = int(stat.rsplit(")", 1)[1].split()[19])  # the fields after the command name: state is field 3
    return {"boot": Path("/proc/sys/kernel/random/boot_id").read_text().strip(), "pid": pid, "start": start}


def held(run_dir: Path) -> bool:
    """Whether a running process holds the arm trained in `run_dir` (its claim names a live process)."""
    try:
        holder = json.loads((run_dir / CLAIM).read_text())
    except (OSError, ValueError):
        return False
    return process_id(holder["pid"]) == holder


def ready(arm: Arm, done: Mapping[str, dict]) -> bool:
    """Whether the arm can start: a WiSE-FT point needs its unregularized run's row."""
    if arm.method != "wiseft":
        return True
    return Arm(arm.optimizer, "unregularized", 0.0, arm.seed).key in done


def claim_next(arms: Sequence[Arm], done: Mapping[str, dict], run_dir: Callable[[Arm], Path]) -> Arm | None:
    """The first arm in plan order without a row that is ready and no running process holds, claimed for this
    process (call under `exclusive`); None when there is none."""
    for arm in arms:
        if arm.key in done or not ready(arm, done) or held(run_dir(arm)):
            continue
        run_dir(arm).mkdir(parents=True, exist_ok=True)
        (run_dir(arm) / CLAIM).write_text(json.dumps(process_id()))
        return arm
    return None
