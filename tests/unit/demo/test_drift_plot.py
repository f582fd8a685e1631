"""The demo's plot says what it shows: its title gives each arm's first and last drift from the numbers
plotted, the legend names lam, and the first (step 1) and last points are marked and labelled."""

import pytest

from hf_cfp.demo.plot import FREE, SENSITIVE, describe_paths, drift_figure, save_drift_plot


def history(sensitive: list[float], free: list[float]) -> list[dict]:
    return [{"step": k, SENSITIVE: s, FREE: f} for k, (s, f) in enumerate(zip(sensitive, free, strict=True), 1)]


HISTORIES = {
    "plain": history([0.01, 0.05, 0.12], [0.2, 0.4, 0.6]),
    "cfp": history([0.008, 0.02, 0.033], [0.2, 0.41, 0.63]),  # still rising: the title must not say it stops
}


def test_the_title_states_each_arms_first_and_last_drift():
    assert describe_paths(HISTORIES) == (
        "plain: sensitive 0.01 → 0.12, free 0.2 → 0.6\ncfp: sensitive 0.008 → 0.033, free 0.2 → 0.63"
    )


def test_the_figure_marks_start_and_end_and_names_lam():
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (the `demo` extra)")
    (ax,) = drift_figure(HISTORIES, {"plain": 0.0, "cfp": 0.00496}).axes
    assert ax.get_title().startswith("Drift from θ0 over 3 steps, step 1 (○) to 3 (□)\n")
    assert describe_paths(HISTORIES) in ax.get_title() and "stops" not in ax.get_title()
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["plain (lam = 0)", "cfp (lam = 0.00496)"]
    labels = {(t.get_text(), t.xy) for t in ax.texts}
    assert labels == {
        ("step 1", (0.2, 0.01)),
        ("step 3", (0.6, 0.12)),
        ("step 1", (0.2, 0.008)),
        ("step 3", (0.63, 0.033)),
    }


def test_the_plot_is_written(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (the `demo` extra)")
    save_drift_plot(HISTORIES, {"plain": 0.0, "cfp": 0.00496}, tmp_path / "drift.png")
    assert (tmp_path / "drift.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert capsys.readouterr().out == f"Plot: {tmp_path / 'drift.png'}\n"
