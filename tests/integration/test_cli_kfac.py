"""The command line with K-FAC anchors: `hf-cfp estimate --structure kfac` on a local model directory, `inspect`
showing the structure and the factors' size, `compare` of two K-FAC anchors with their factor cosines, and the
refusal to compare a K-FAC anchor with a diagonal one."""

import pytest
from support.tiny import tiny_llama, tiny_tokenizer

from hf_cfp import FisherAnchor
from hf_cfp.cli import main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("model")
    tokenizer = tiny_tokenizer()
    tiny_llama(vocab_size=len(tokenizer)).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def estimate(model_dir, output, *extra):
    common = ["--num-sequences", "4", "--max-new-tokens", "4", "--batch-size", "2", "--prompts", "math"]
    main(["estimate", "--model", str(model_dir), "--output", str(output), *common, *extra])


def test_estimate_inspect_and_compare_kfac_anchors(model_dir, tmp_path, capsys):
    estimate(model_dir, tmp_path / "full", "--structure", "kfac")
    estimate(model_dir, tmp_path / "top4", "--structure", "kfac", "--kfac-rank", "4", "--seed", "1")
    estimate(model_dir, tmp_path / "flat")
    full, top = FisherAnchor.from_pretrained(tmp_path / "full"), FisherAnchor.from_pretrained(tmp_path / "top4")
    assert full.structure == "kfac" and len(full.kfac_names) == 15  # 2 layers x 7 Linear weights, and lm_head
    assert {b.a_values.numel() for b in top.kfac.values()} == {4}
    assert "structure='kfac'" in capsys.readouterr().out
    main(["inspect", str(tmp_path / "top4")])
    out = capsys.readouterr().out
    assert "  structure      kfac: 15 Linear weights as A (x) G eigenbases (eigenpairs per factor: 4;" in out
    assert "30 truncated factors, their tails carry" in out  # every factor is wider than 4
    main(["inspect", str(tmp_path / "flat")])
    assert "  structure      diagonal\n" in capsys.readouterr().out
    main(["compare", str(tmp_path / "full"), str(tmp_path / "top4")])
    out = capsys.readouterr().out
    assert "K-FAC factors, mean over weights: cosine(A_A, A_B)" in out
    with pytest.raises(SystemExit) as exited:
        main(["compare", str(tmp_path / "full"), str(tmp_path / "flat")])
    assert exited.value.code != 0
    assert "Kronecker-factored (structure 'kfac')" in capsys.readouterr().err
