"""The command line: the tiny demo end to end, and `inspect`."""

import json

from hf_cfp import FisherAnchor
from hf_cfp.cli import main
from hf_cfp.demo import run_demo


def test_tiny_demo_protects_the_capability_and_reports(tmp_path, capsys):
    result = run_demo(tiny=True, steps=6, num_sequences=16, max_new_tokens=6, output_dir=str(tmp_path))
    key = "cfp/math/sensitive_drift"
    plain, cfp = result["plain"], result["cfp"]
    assert [r["step"] for r in plain] == [r["step"] for r in cfp] == list(range(1, 7))
    assert all(c[key] < p[key] for p, c in zip(plain, cfp))
    assert result["ratio"] == cfp[-1][key] ** 2 / plain[-1][key] ** 2 - 1 < -0.5
    anchor = FisherAnchor.from_pretrained(tmp_path / "anchor-math")
    assert result["lam"] == 1.0 / anchor.metadata["statistics"]["p99"]
    assert (tmp_path / "drift.png").stat().st_size > 10_000
    assert "DtFD_cfp / DtFD_plain - 1" in capsys.readouterr().out


def test_inspect_prints_the_metadata(tmp_path, capsys):
    FisherAnchor({"w": [1.0, 3.0]}, name="code", metadata={"num_sequences": 7}).save_pretrained(tmp_path)
    main(["inspect", str(tmp_path)])
    out = capsys.readouterr().out
    assert out.startswith("FisherAnchor(name='code', tensors=1, coordinates=2)")
    metadata = json.loads(out[out.index("{"):])
    assert metadata["num_sequences"] == 7 and metadata["statistics"]["total_mass"] == 4.0
