"""`support.tiny.run_cpu_processes` starts a launch again only when it failed with torch's gloo teardown abort,
and once: each fake launcher below counts its starts in a file and fails with a given message while the count
is below its limit."""

import sys

import pytest
from support.tiny import GLOO_TEARDOWN_ABORT, run_cpu_processes

FAKE_LAUNCHER = """
import pathlib, sys
counter, message, failures = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
starts = int(counter.read_text()) + 1 if counter.exists() else 1
counter.write_text(str(starts))
if starts <= failures:
    sys.exit(message)
print("finished")
"""


@pytest.mark.parametrize(
    ("message", "failures", "starts", "returncode"),
    [
        (GLOO_TEARDOWN_ABORT, 1, 2, 0),  # the abort once: started again, and the second start succeeds
        (GLOO_TEARDOWN_ABORT, 2, 2, 1),  # the abort twice: started again once only, the failure is returned
        ("RuntimeError: wrong shape", 1, 1, 1),  # any other failure: not started again
        (GLOO_TEARDOWN_ABORT, 0, 1, 0),  # a success: started once
    ],
)
def test_only_the_teardown_abort_is_started_again_and_once(tmp_path, message, failures, starts, returncode):
    counter = tmp_path / "starts"
    command = [sys.executable, "-c", FAKE_LAUNCHER, counter, message, failures]
    if starts == 2:
        with pytest.warns(UserWarning, match="gloo teardown abort"):
            run = run_cpu_processes(command, timeout=60, env=None)
    else:
        run = run_cpu_processes(command, timeout=60, env=None)
    assert int(counter.read_text()) == starts
    assert run.returncode == returncode
    assert ("finished" in run.stdout) == (returncode == 0)
