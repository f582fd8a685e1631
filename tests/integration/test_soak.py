"""A shortened soak run (scripts/soak.py, issue 6): memory flat, metrics finite, no file-descriptor leak."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _soak_module():
    spec = importlib.util.spec_from_file_location("cfp_soak", ROOT / "scripts" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shortened_soak_memory_flat_metrics_finite_no_fd_leak():
    result = _soak_module().soak(steps=60, warmup=20, every=10)
    assert result["finite"] and result["logs"] == 60
    assert len(result["cfp_keys"]) == 7  # 3 anchors x (sensitive, free) + total
    assert result["fd_growth"] <= 0, result
    assert result["rss_growth_mb"] < 50, result["rss"]
    assert sorted(result["rss"]) == [10, 20, 30, 40, 50, 60]
