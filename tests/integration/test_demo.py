"""The tiny demo end to end (`run_demo(tiny=True)`, what `hf-cfp demo --tiny` runs): the protected
arm's sensitive drift stays below the plain arm's, and the report and the plot are written. By default
the math anchor is K-FAC at rank 256 with tails (the tiny model's factors are all narrower, so each keeps
every eigenpair); `structure="diagonal"` gives a diagonal anchor, `kfac_rank=None` full rank. With
`peft=True` (`hf-cfp demo --tiny --peft`) the arms train LoRA adapters and the logged drift is that of
the merged model against the base weights, checked here against PEFT's own merge_and_unload(). Both print
the capability lines (kl_to_base, answer log-likelihood, exact match on held-out prompts), checked against
kl_to_base and the scores computed afresh on the returned models."""

import copy
import re
from typing import TYPE_CHECKING

import pytest
import torch
from support.extras import needs
from support.references import drift_reference

from hf_cfp import FisherAnchor, kl_to_base
from hf_cfp.demo import run_demo
from hf_cfp.demo.capability import held_out_math
from hf_cfp.demo.run import LORA_TARGETS
from hf_cfp.evaluation import greedy_exact_match, reference_log_likelihood
from hf_cfp.loading.models import tiny_llama

if TYPE_CHECKING:
    from peft import PeftModel

KEY = "cfp/math/sensitive_drift"


def check_capability_lines(result, out: str) -> None:
    """The printed and returned capability numbers against kl_to_base (8 held-out prompts x 2 samples,
    32 tokens, seed 0) and the scores computed afresh; the tiny base is rebuilt from its seed."""
    assert "Capability on 8 random token-id stand-ins (tiny model)" in out
    printed = {
        m.group(1): m.groups()[1:]
        for m in re.finditer(r"^\s*(base|plain|cfp) \|\s+(\S+)\s+(\S+) \|\s+(\S+) \|\s+(\S+)%$", out, re.M)
    }
    assert set(printed) == {"base", "plain", "cfp"}
    base = tiny_llama(vocab_size=64, hidden_size=32, heads=4)  # _tiny_setup's model, untrained
    prompts, answers = held_out_math(tiny=True)
    rows = result["capability"]
    assert rows["base"]["kl"] == 0.0
    for arm in ("plain", "cfp"):
        model = result["models"][arm]
        expected = kl_to_base(base, model, None, prompts, num_samples_per_prompt=2, max_new_tokens=32, seed=0)
        assert rows[arm]["kl"] == pytest.approx(expected, rel=1e-9, abs=1e-12), arm
        assert float(printed[arm][0]) == pytest.approx(expected, rel=1e-4), arm
        assert rows[arm]["kl"] != 0.0 and rows[arm]["kl_stderr"] > 0.0  # an estimate: 16 samples may give < 0
        assert rows[arm]["log_likelihood"] == pytest.approx(reference_log_likelihood(model, None, prompts, answers))
        assert float(printed[arm][2]) == pytest.approx(rows[arm]["log_likelihood"], abs=1e-4)
        assert rows[arm]["exact_match"] == greedy_exact_match(model, None, prompts, answers, max_new_tokens=16)


def test_tiny_demo_protects_the_capability_and_reports(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the demo's plot (drift.png) needs matplotlib (the `demo` extra)")
    threads = torch.get_num_threads()
    result = run_demo(tiny=True, steps=6, num_sequences=16, max_new_tokens=6, output_dir=str(tmp_path))
    assert torch.get_num_threads() == threads  # the tiny demo ran on one thread, then restored the count
    plain, cfp = result["plain"], result["cfp"]
    assert [r["step"] for r in plain] == [r["step"] for r in cfp] == list(range(1, 7))
    assert all(c[KEY] < p[KEY] for p, c in zip(plain, cfp, strict=True))
    assert result["ratio"] == cfp[-1][KEY] ** 2 / plain[-1][KEY] ** 2 - 1 < -0.5
    anchor = FisherAnchor.from_pretrained(tmp_path / "anchor-math")
    assert result["lam"] == 1.0 / anchor.metadata["statistics"]["p99"]
    assert anchor.structure == "kfac" and anchor.metadata["kfac_rank"] == 256  # the default geometry
    assert_every_factor_whole(anchor)  # 256 is wider than every tiny factor: all eigenpairs, no tail
    assert (tmp_path / "drift.png").stat().st_size > 10_000
    captured = capsys.readouterr()
    out = captured.out
    assert "Geometry: K-FAC rank 256 + tails (the default)" in out and "docs/reports/evidence.md" in out
    assert "Estimating the math anchor (K-FAC, rank 256 + tails)" in out
    assert "15 Linear weights as A (x) G, 0 of their 30 factors truncated" in out
    assert "DtFD_cfp / DtFD_plain - 1" in out
    starts = re.findall(r"^\[(\d)/5\] (?!done)", out, re.M)
    assert starts == ["1", "2", "3", "4", "5"] and len(re.findall(r"^\[\d/5\] done in \d+ s$", out, re.M)) == 5
    assert "16 responses of up to 6 tokens sampled from the model on 16 of the 16 calibration prompts" in out
    assert "arm plain: 100%" in captured.err and "arm cfp: 100%" in captured.err  # a bar per training arm
    check_capability_lines(result, out)


def assert_every_factor_whole(anchor: FisherAnchor) -> None:
    """Every K-FAC factor of `anchor` keeps all its eigenpairs and has no tail."""
    for name, basis in anchor.kfac.items():
        assert basis.a_values.numel() == basis.a_vectors.shape[0] <= 256, name
        assert basis.g_values.numel() == basis.g_vectors.shape[0] <= 256, name
        assert not basis.tailed, name
    assert anchor.metadata["kfac"]["truncated"] == 0


def test_tiny_demo_with_a_kfac_anchor_protects_its_quadratic(tmp_path):
    pytest.importorskip("matplotlib", reason="the demo's plot (drift.png) needs matplotlib (the `demo` extra)")
    result = run_demo(
        tiny=True,
        steps=6,
        num_sequences=16,
        max_new_tokens=6,
        output_dir=str(tmp_path),
        structure="kfac",
        kfac_rank=None,  # full rank (the demo's default before it took rank 256)
    )
    anchor = FisherAnchor.from_pretrained(tmp_path / "anchor-math")
    assert anchor.structure == "kfac" and result["lam"] == 1.0 / anchor.metadata["statistics"]["p99"]
    assert anchor.metadata["kfac_rank"] is None
    assert all(c[KEY] < p[KEY] for p, c in zip(result["plain"], result["cfp"], strict=True))
    assert result["ratio"] < -0.5


def test_tiny_demo_with_structure_diagonal_keeps_a_diagonal_anchor(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the demo's plot (drift.png) needs matplotlib (the `demo` extra)")
    result = run_demo(
        tiny=True, steps=6, num_sequences=16, max_new_tokens=6, output_dir=str(tmp_path), structure="diagonal"
    )
    anchor = FisherAnchor.from_pretrained(tmp_path / "anchor-math")
    assert anchor.structure == "diagonal" and not anchor.kfac and "kfac_rank" not in anchor.metadata
    assert result["lam"] == 1.0 / anchor.metadata["statistics"]["p99"]
    assert all(c[KEY] < p[KEY] for p, c in zip(result["plain"], result["cfp"], strict=True))
    out = capsys.readouterr().out
    assert "Geometry: diagonal F (--structure diagonal): cheaper and weaker" in out
    assert "K-FAC rank 256 + tails, is what the evidence recommends (docs/reports/evidence.md)" in out
    assert "Estimating the math anchor (diagonal)" in out and "Linear weights as A (x) G" not in out


def merged_drift(model: "PeftModel", fisher: dict[str, torch.Tensor]) -> dict[str, float]:
    """The drift metrics recomputed from PEFT's merged model minus its base weights, in float64."""
    base = copy.deepcopy(model).unload().state_dict()
    merged = copy.deepcopy(model).merge_and_unload().state_dict()
    assert base.keys() == merged.keys()
    adapted = [n for n in merged if n.endswith(tuple(f"{t}.weight" for t in LORA_TARGETS))]
    assert len(adapted) == 2 * len(LORA_TARGETS)  # two layers
    assert all(torch.equal(merged[n], base[n]) for n in merged if n not in adapted)  # frozen weights stay
    delta = {n: merged[n].double() - base[n].double() for n in adapted}
    return drift_reference(delta, fisher, "math")  # the free threshold over the weights that can move


def test_tiny_peft_demo_protects_in_base_space_and_logs_the_merged_drift(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the demo's plot (drift.png) needs matplotlib (the `demo` extra)")
    needs("peft")
    from peft import PeftModel

    result = run_demo(
        tiny=True,
        peft=True,
        steps=6,
        num_sequences=16,
        max_new_tokens=6,
        output_dir=str(tmp_path),
        structure="diagonal",  # the drift reference below is the diagonal F's (the default became K-FAC)
    )
    plain, cfp = result["plain"], result["cfp"]
    assert [r["step"] for r in plain] == [r["step"] for r in cfp] == list(range(1, 7))
    assert all(c[KEY] < p[KEY] for p, c in zip(plain, cfp, strict=True))
    assert result["ratio"] == cfp[-1][KEY] ** 2 / plain[-1][KEY] ** 2 - 1 < -0.3
    assert all(0 < r["cfp/math/adapter_residual"] < 0.1 for r in cfp)  # measured on every (logging) step
    assert "cfp/math/adapter_residual" not in plain[-1]  # lam = 0 corrects nothing
    assert result["learning_rate"] == 3e-2
    anchor = FisherAnchor.from_pretrained(tmp_path / "anchor-math")
    for arm, rows in (("plain", plain), ("cfp", cfp)):
        model = result["models"][arm]
        assert isinstance(model, PeftModel)
        assert {n for n, p in model.named_parameters() if p.requires_grad} == {
            n for n, _ in model.named_parameters() if ".lora_A." in n or ".lora_B." in n
        }
        expected = merged_drift(model, anchor.fisher)
        for key, value in expected.items():
            assert rows[-1][key] == pytest.approx(value, rel=1e-6), (arm, key)
    out = capsys.readouterr().out
    assert "Drift of the merged model (base + LoRA) from the base weights" in out
    assert "residual cfp" in out and "DtFD_cfp / DtFD_plain - 1" in out
    check_capability_lines(result, out)


def test_tiny_peft_demo_protects_with_the_default_kfac_anchor(tmp_path):
    pytest.importorskip("matplotlib", reason="the demo's plot (drift.png) needs matplotlib (the `demo` extra)")
    needs("peft")
    result = run_demo(tiny=True, peft=True, steps=4, num_sequences=16, max_new_tokens=6, output_dir=str(tmp_path))
    anchor = FisherAnchor.from_pretrained(tmp_path / "anchor-math")
    assert anchor.structure == "kfac" and anchor.metadata["kfac_rank"] == 256
    plain, cfp = result["plain"], result["cfp"]
    assert all(c[KEY] < p[KEY] for p, c in zip(plain, cfp, strict=True))
    assert all(0 < r["cfp/math/adapter_residual"] < 1 for r in cfp)
