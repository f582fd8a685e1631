"""Several workers on one long run: each claims the first arm no running process holds, takes over an arm whose
process is gone (or whose pid now names another process), lets a WiSE-FT point wait for its unregularized run, and
the shared files are written under a lock another process cannot take meanwhile."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

if not Path("/proc/self/stat").exists():
    pytest.skip("the workers name processes through /proc (Linux)", allow_module_level=True)

from evidence.plan import Arm  # noqa: E402
from longrun.workers import CLAIM, claim_next, exclusive, process_id  # noqa: E402

ARMS = [
    Arm("sft", "unregularized", 0.0, 1),
    Arm("sft", "kfac", 1.0, 1, "math_t256"),
    Arm("sft", "wiseft", 0.5, 1),
    Arm("sft", "kl", 0.3, 1),
]


def run_dirs(tmp_path):
    return lambda arm: tmp_path / "runs" / arm.key.replace("/", "_")


def claim_of(tmp_path, arm) -> dict:
    return json.loads((run_dirs(tmp_path)(arm) / CLAIM).read_text())


def hold(tmp_path, arm, holder: dict) -> None:
    directory = run_dirs(tmp_path)(arm)
    directory.mkdir(parents=True)
    (directory / CLAIM).write_text(json.dumps(holder))


@pytest.fixture
def other_process():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield child
    child.kill()
    child.wait()


def test_the_first_arm_without_a_row_is_claimed_for_this_process(tmp_path):
    arm = claim_next(ARMS, {"base": {}, ARMS[0].key: {}}, run_dirs(tmp_path))
    assert arm == ARMS[1]
    assert claim_of(tmp_path, arm) == process_id()


def test_an_arm_held_by_another_running_process_is_skipped(tmp_path, other_process):
    hold(tmp_path, ARMS[0], process_id(other_process.pid))
    assert claim_next(ARMS, {}, run_dirs(tmp_path)) == ARMS[1]
    assert claim_of(tmp_path, ARMS[0])["pid"] == other_process.pid  # the other's claim untouched


def test_an_arm_whose_process_is_gone_is_taken_over(tmp_path, other_process):
    holder = process_id(other_process.pid)
    hold(tmp_path, ARMS[0], holder)
    other_process.kill()
    other_process.wait()
    assert process_id(other_process.pid)["start"] is None
    assert claim_next(ARMS, {}, run_dirs(tmp_path)) == ARMS[0]
    assert claim_of(tmp_path, ARMS[0]) == process_id()


def test_a_reused_pid_or_another_boot_does_not_hold_the_arm(tmp_path, other_process):
    live = process_id(other_process.pid)
    hold(tmp_path, ARMS[0], {**live, "start": live["start"] - 1})  # the pid's earlier owner
    hold(tmp_path, ARMS[1], {**live, "boot": "a machine since replaced"})
    assert claim_next(ARMS, {}, run_dirs(tmp_path)) == ARMS[0]
    assert claim_next(ARMS, {ARMS[0].key: {}}, run_dirs(tmp_path)) == ARMS[1]


def test_a_wiseft_point_waits_for_its_unregularized_row(tmp_path, other_process):
    hold(tmp_path, ARMS[0], process_id(other_process.pid))  # the unregularized run still training elsewhere
    done = {ARMS[1].key: {}}
    assert claim_next(ARMS, done, run_dirs(tmp_path)) == ARMS[3]
    assert claim_next(ARMS, {**done, ARMS[0].key: {}}, run_dirs(tmp_path)) == ARMS[2]


def test_no_arm_left_gives_none(tmp_path):
    assert claim_next(ARMS, {arm.key: {} for arm in ARMS}, run_dirs(tmp_path)) is None


def test_another_process_cannot_take_the_lock_while_it_is_held(tmp_path):
    probe = (
        "import fcntl, sys\n"
        f"handle = open({str(tmp_path / '.lock')!r}, 'a')\n"
        "try:\n    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept BlockingIOError:\n    sys.exit(3)\n"
    )
    with exclusive(tmp_path):
        assert subprocess.run([sys.executable, "-c", probe]).returncode == 3
    assert subprocess.run([sys.executable, "-c", probe]).returncode == 0
