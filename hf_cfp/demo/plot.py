"""The demo's plot: each arm's path from theta0 in the plane (free drift, sensitive drift), one point per step.

The title says what is drawn and, from the numbers themselves, how far each arm's sensitive drift went from
step 1 to the last step; the legend names each arm's lam; the first and last points are marked.
matplotlib is optional (the `demo` extra): without it the demo prints its table only.
"""

from pathlib import Path

SENSITIVE, FREE = "cfp/math/sensitive_drift", "cfp/math/free_drift"


def describe_paths(histories: dict[str, list[dict]]) -> str:
    """One line per arm: `<arm>: sensitive <first> -> <last>, free <first> -> <last>` (first and last logged
    steps), so the title states what the curves do instead of a claim they might contradict."""
    return "\n".join(
        f"{arm}: sensitive {rows[0][SENSITIVE]:.3g} → {rows[-1][SENSITIVE]:.3g}, "
        f"free {rows[0][FREE]:.3g} → {rows[-1][FREE]:.3g}"
        for arm, rows in histories.items()
    )


def drift_figure(histories: dict[str, list[dict]], lams: dict[str, float]):
    """The figure: for each arm (legend `<arm> (lam = <lam>)`), sensitive drift sqrt(sum_i F_i Delta_i^2)
    against free drift ||Delta|| over the 99% lowest-Fisher coordinates, a point per logged step, the first
    (step 1) circled and the last squared, each labelled with its step."""
    from matplotlib.figure import Figure  # optional (the `demo` extra); no pyplot, so no display or backend

    fig = Figure(figsize=(6.4, 4.8))
    ax = fig.subplots()
    for arm, rows in histories.items():
        x, y = [r[FREE] for r in rows], [r[SENSITIVE] for r in rows]
        (line,) = ax.plot(x, y, marker="o", markersize=3, label=f"{arm} (lam = {lams[arm]:.3g})")
        for index, marker in ((0, "o"), (-1, "s")):
            ax.plot(x[index], y[index], marker=marker, markersize=9, markerfacecolor="none", color=line.get_color())
            ax.annotate(
                f"step {rows[index]['step']}",
                (x[index], y[index]),
                textcoords="offset points",
                xytext=(6, -10 if index == 0 else 6),
                fontsize=8,
                color=line.get_color(),
            )
    steps = max(rows[-1]["step"] for rows in histories.values())
    ax.set_xlabel("free drift ||Δ|| (99% lowest-Fisher coordinates)")
    ax.set_ylabel("sensitive drift sqrt(Σ F Δ²), math anchor")
    ax.set_title(
        f"Drift from θ0 over {steps} steps, step 1 (○) to {steps} (□)\n" + describe_paths(histories), fontsize=9
    )
    ax.legend()
    fig.tight_layout()
    return fig


def save_drift_plot(histories: dict[str, list[dict]], lams: dict[str, float], path: Path) -> None:
    """Write `drift_figure` to `path` (PNG), or say that matplotlib is missing."""
    try:
        fig = drift_figure(histories, lams)
    except ImportError:
        print("(matplotlib not installed: no plot; `pip install matplotlib`)")
        return
    fig.savefig(path, dpi=120)
    print(f"Plot: {path}")
