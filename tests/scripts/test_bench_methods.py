"""`scripts/bench_methods.py --tiny`: every first-strength arm of the chosen optimizers is trained for its steps in
every round, all but the warm-up step timed, and each printed ratio is the median of the arm's timed steps over
the median of its optimizer's unregularized arm; bad arguments stop with what is wrong."""

import statistics

import pytest
from support.extras import needs

needs("trl", "datasets", "peft")

from bench_methods import bench_arms, main  # noqa: E402
from longrun.plan import TINY  # noqa: E402

OPTIMIZERS = ["sft", "grpo-pirate"]


def test_every_arm_is_timed_and_compared_to_its_unregularized_step(capsys):
    seconds = main(["--tiny", "--optimizers", ",".join(OPTIMIZERS), "--steps", "3", "--rounds", "2"])
    arms = bench_arms(TINY, OPTIMIZERS)
    assert list(seconds) == [arm.key for arm in arms]
    assert "sft/lwf[math]@1/seed0" in seconds and not any("wiseft" in key for key in seconds)
    assert all(len(values) == 2 * (3 - 1) and min(values) > 0 for values in seconds.values())
    out = capsys.readouterr().out
    for optimizer in OPTIMIZERS:
        base = statistics.median(seconds[f"{optimizer}/unregularized@0/seed0"])
        for arm in (a for a in arms if a.optimizer == optimizer):
            assert f"RESULT {arm.key}={statistics.median(seconds[arm.key]) / base:.3f}" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "1"], "--steps must be at least 2"),
        (["--optimizers", "sft,rloo"], "unknown optimizers ['rloo']"),
    ],
)
def test_bad_arguments_say_what_is_wrong(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(["--tiny", *argv])
    assert message in capsys.readouterr().err
