"""The tiny demo end to end (`run_demo(tiny=True)`, what `hf-cfp demo --tiny` runs): the protected
arm's sensitive drift stays below the plain arm's, and the report and the plot are written."""

import pytest

from hf_cfp import FisherAnchor
from hf_cfp.demo import run_demo


def test_tiny_demo_protects_the_capability_and_reports(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the demo's plot (drift.png) needs matplotlib (the `demo` extra)")
    result = run_demo(tiny=True, steps=6, num_sequences=16, max_new_tokens=6, output_dir=str(tmp_path))
    key = "cfp/math/sensitive_drift"
    plain, cfp = result["plain"], result["cfp"]
    assert [r["step"] for r in plain] == [r["step"] for r in cfp] == list(range(1, 7))
    assert all(c[key] < p[key] for p, c in zip(plain, cfp, strict=True))
    assert result["ratio"] == cfp[-1][key] ** 2 / plain[-1][key] ** 2 - 1 < -0.5
    anchor = FisherAnchor.from_pretrained(tmp_path / "anchor-math")
    assert result["lam"] == 1.0 / anchor.metadata["statistics"]["p99"]
    assert (tmp_path / "drift.png").stat().st_size > 10_000
    assert "DtFD_cfp / DtFD_plain - 1" in capsys.readouterr().out
