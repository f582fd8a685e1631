"""The demo's default geometry is the one the evidence recommends (K-FAC, rank 256 with tails), and the demo says
in two lines which geometry its math anchor uses and why: the default as the evidence's recommendation, any other
choice beside that recommendation."""

import inspect

import pytest

from hf_cfp.demo.run import KFAC_RANK, geometry_line, run_demo

RECOMMENDED = "K-FAC rank 256 + tails, is what the evidence recommends (docs/reports/evidence.md)"


def test_the_default_geometry_is_kfac_rank_256_with_tails():
    parameters = inspect.signature(run_demo).parameters
    assert parameters["structure"].default == "kfac"
    assert parameters["kfac_rank"].default == KFAC_RANK == 256


LINES = {
    ("kfac", 256): (
        "Geometry: K-FAC rank 256 + tails (the default): A (x) G of each Linear weight, each factor's top 256 "
        "eigenpairs and the mean of the rest.",
        "Why: it is what the evidence recommends (docs/reports/evidence.md); --structure diagonal is cheaper and "
        "weaker.",
    ),
    ("kfac", None): (
        "Geometry: K-FAC at full rank (--kfac-rank full): A (x) G of each Linear weight, every eigenpair of each "
        "factor.",
        f"The default, {RECOMMENDED}: it protects as well, in less time.",
    ),
    ("kfac", 64): (
        "Geometry: K-FAC rank 64 + tails (--kfac-rank 64): A (x) G of each Linear weight, each factor's top 64 "
        "eigenpairs and the mean of the rest.",
        f"The default, {RECOMMENDED}.",
    ),
    ("diagonal", None): (
        "Geometry: diagonal F (--structure diagonal): cheaper and weaker; in the evidence a diagonal anchor protects "
        "held-out math",
        f"no better than an isotropic pull. The default, {RECOMMENDED}.",
    ),
}


@pytest.mark.parametrize("geometry", LINES)
def test_the_geometry_lines_name_the_choice_and_the_recommendation(geometry):
    assert geometry_line(*geometry).split("\n") == list(LINES[geometry])
