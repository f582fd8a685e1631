"""`hf-cfp inspect`: the summary shows the anchor's metadata values and each module type's share of the mass
(checked against a plain sum over the tensors) without reading a tensor; `--full` prints all of it."""

import json
import math
import re

import pytest
import torch

from hf_cfp import FisherAnchor
from hf_cfp.cli import main

TENSORS = {
    "model.layers.0.self_attn.q_proj.weight": (8, 4),
    "model.layers.1.self_attn.q_proj.weight": (8, 4),
    "model.layers.0.mlp.up_proj.weight": (16, 4),
    "model.norm.weight": (4,),
    "lm_head.weight": (10, 4),
}
METADATA = {
    "base_model": "org/tiny-base",
    "base_model_revision": "abc123",
    "estimator": "sequence",
    "sampler": {"temperature": 0.7, "top_k": 20, "top_p": 0.9, "max_new_tokens": 64},
    "num_sequences": 12,
    "num_prompts": 6,
    "num_samples_per_prompt": 2,
    "mean_response_tokens": 31.25,
    "split_half": {"top1pct_overlap": 0.5, "mass_relative_difference": 0.125, "num_sequences": [6, 6]},
    "library_version": "0.1.0",
    "created_at": "2026-12-01T00:00:00+00:00",
    "base_fingerprint": {"parameters": {name: "float32[..]" for name in TENSORS}},
}


@pytest.fixture
def saved(tmp_path):
    generator = torch.Generator().manual_seed(0)
    fisher = {name: torch.rand(shape, generator=generator) ** 4 for name, shape in TENSORS.items()}
    FisherAnchor(fisher, name="math", metadata=METADATA).save_pretrained(tmp_path / "anchor")
    return tmp_path / "anchor", fisher


def summary_rows(out: str) -> dict[str, str]:
    """label -> text of the summary's `  label   text` lines."""
    return {m[1]: m[2] for m in re.finditer(r"^  (\S+(?: \S+)?)\s{2,}(.+)$", out, re.MULTILINE)}


def test_summary_shows_the_metadata_and_mass_per_module_type_without_reading_a_tensor(saved, capsys, monkeypatch):
    directory, fisher = saved
    monkeypatch.setattr("hf_cfp.anchor.storage.safe_open", lambda *a, **k: pytest.fail("a tensor file was read"))
    main(["inspect", str(directory)])
    out = capsys.readouterr().out
    flat = torch.cat([t.reshape(-1) for t in fisher.values()]).double()
    total, n = float(flat.sum()), flat.numel()
    assert out.startswith(f"Anchor 'math': {n:,} coordinates\n")
    rows = summary_rows(out)
    assert rows["base model"] == "org/tiny-base (revision abc123)"
    assert rows["estimator"] == "sequence: 12 sequences from 6 prompts (2 per prompt), 31.2 response tokens on average"
    assert rows["sampler"] == "temperature 0.7, top_k 20, top_p 0.9, max_new_tokens 64"
    p99 = float(flat.sort().values[math.ceil(0.99 * n) - 1])
    top1 = float(flat.sort(descending=True).values[: math.ceil(0.01 * n)].sum()) / total
    assert rows["statistics"] == (
        f"total mass {total:.4g}, mean {total / n:.3g}, p99 {p99:.3g}, max {float(flat.max()):.3g}; "
        f"top 1% holds {top1:.1%}"
    )
    assert rows["lam scale"].startswith(f"1 / p99 = {1 / p99:.4g} ")
    assert rows["split-half"] == "top-1% overlap 0.500, total mass differs by 12.5% between the halves"
    assert rows["created"] == "2026-12-01T00:00:00+00:00 with hf-cfp 0.1.0"
    per_type: dict[str, list[float]] = {}  # plain loop: type -> [mass, count]
    for name, tensor in fisher.items():
        kind = name.split(".")[-2] if "." in name else name
        entry = per_type.setdefault(kind, [0.0, 0])
        entry[0] += float(tensor.double().sum())
        entry[1] += tensor.numel()
    ordered = sorted(per_type, key=lambda kind: -per_type[kind][0])
    shown = re.findall(r"^  (\w+)\s+([\d.]+)%\s+([\d,]+)$", out, re.MULTILINE)
    assert [kind for kind, _, _ in shown] == ordered
    for kind, share, count in shown:
        assert share == f"{100 * per_type[kind][0] / total:.1f}" and int(count.replace(",", "")) == per_type[kind][1]
    assert rows["structure"] == "diagonal"
    assert "base_fingerprint" not in out and len(out.splitlines()) == 1 + 8 + 1 + len(ordered) + 1


def test_an_anchor_saved_without_module_types_says_so_and_full_computes_them(saved, capsys):
    directory, fisher = saved
    config = json.loads((directory / "cfp_config.json").read_text())
    del config["metadata"]["module_types"]  # as saved by an earlier hf-cfp
    (directory / "cfp_config.json").write_text(json.dumps(config))
    main(["inspect", str(directory)])
    assert "mass by module type: not stored with this anchor" in capsys.readouterr().out
    main(["inspect", str(directory), "--full"])
    out = capsys.readouterr().out
    assert out.startswith(f"FisherAnchor(name='math', tensors={len(TENSORS)}, coordinates=")
    printed = json.loads(out[out.index("{") :])
    assert printed["base_fingerprint"] == METADATA["base_fingerprint"]
    total = sum(float(t.double().sum()) for t in fisher.values())
    shares = {row["type"]: row["share"] for row in printed["concentration"]["module_types"]}
    up = float(fisher["model.layers.0.mlp.up_proj.weight"].double().sum())
    assert shares["up_proj"] == pytest.approx(up / total, rel=1e-12)
