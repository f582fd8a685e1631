"""The command line: `inspect` on a directory, and `push` / `pull` / `inspect` against the local fake
Hub (tests/support/hub_server.py)."""

import json

import pytest
from support.anchors import same_anchor
from support.tiny import anchor_for, tiny_llama

from hf_cfp import FisherAnchor
from hf_cfp.cli import main


def test_inspect_full_prints_the_metadata(tmp_path, capsys):
    FisherAnchor({"w": [1.0, 3.0]}, name="code", metadata={"num_sequences": 7}).save_pretrained(tmp_path)
    main(["inspect", str(tmp_path), "--full"])
    out = capsys.readouterr().out
    assert out.startswith("FisherAnchor(name='code', tensors=1, coordinates=2)")
    metadata = json.loads(out[out.index("{") :])
    assert metadata["num_sequences"] == 7 and metadata["statistics"]["total_mass"] == 4.0


def test_cli_push_pull_inspect(local_hub, tmp_path, capsys):
    anchor_for(tiny_llama()).save_pretrained(tmp_path / "a")
    main(["push", str(tmp_path / "a"), "org/base", "--create-pr"])
    assert "pull request" in capsys.readouterr().out
    main(["pull", "org/base@refs/pr/1:cfp/math", "--output", str(tmp_path / "b")])
    assert f"at commit {local_hub.resolve('org/base', 'refs/pr/1')}" in capsys.readouterr().out
    assert same_anchor(FisherAnchor.from_pretrained(tmp_path / "b"), FisherAnchor.from_pretrained(tmp_path / "a"))
    main(["inspect", "org/base@refs/pr/1:cfp/math"])  # the summary, through the Hub
    commit = local_hub.resolve("org/base", "refs/pr/1")
    assert f"  hub            org/base@{commit}:cfp/math (revision refs/pr/1)\n" in capsys.readouterr().out
    main(["inspect", "org/base@refs/pr/1:cfp/math", "--full"])
    out = capsys.readouterr().out
    shares = json.loads(out[out.index("{") :])["concentration"]["top_shares"]
    assert 0 < shares["0.1%"] <= shares["1%"] <= shares["5%"] <= 1


def test_demo_flags_reach_run_demo(monkeypatch):
    calls = []
    monkeypatch.setattr("hf_cfp.cli.demo.run_demo", lambda **kwargs: calls.append(kwargs))
    main(["demo", "--tiny", "--peft", "--steps", "3", "--learning-rate", "0.01", "--structure", "kfac"])
    main(["demo"])
    assert calls[0]["tiny"] and calls[0]["peft"] and calls[0]["steps"] == 3 and calls[0]["learning_rate"] == 0.01
    assert calls[0]["structure"] == "kfac" and calls[1]["structure"] == "kfac"  # the default: kfac (was diagonal)
    assert "kfac_rank" not in calls[1]  # run_demo's own default rank (256, test_demo.py) applies
    assert not calls[1]["tiny"] and not calls[1]["peft"] and calls[1]["learning_rate"] is None


def test_demo_structure_and_rank_flags_reach_run_demo(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr("hf_cfp.cli.demo.run_demo", lambda **kwargs: calls.append(kwargs))
    main(["demo", "--structure", "diagonal"])
    main(["demo", "--kfac-rank", "full"])
    main(["demo", "--kfac-rank", "64"])
    assert calls[0]["structure"] == "diagonal" and "kfac_rank" not in calls[0]
    assert calls[1]["structure"] == "kfac" and calls[1]["kfac_rank"] is None  # full rank: every eigenpair
    assert calls[2]["structure"] == "kfac" and calls[2]["kfac_rank"] == 64
    for flags, message in (
        (["--structure", "diagonal", "--kfac-rank", "64"], "--kfac-rank applies to --structure kfac"),
        (["--kfac-rank", "0"], "--kfac-rank: must be an integer >= 1, got 0 (or 'full': every eigenpair)"),
    ):
        with pytest.raises(SystemExit) as exited:
            main(["demo", *flags])
        assert exited.value.code == 2 and message in capsys.readouterr().err
    assert len(calls) == 3
