"""`hf-cfp estimate` and `hf-cfp diagnose` check every argument and input file before a model loads: run with
a model loader that fails the test if it is called, each mistake exits with code 2 and a message naming it;
with every argument right, the loader is reached (so the patched loader is the one the command uses)."""

import pytest
import torch

from hf_cfp import FisherAnchor
from hf_cfp.cli import main


class LoaderReached(Exception):
    """Raised by the patched loader: the command got past its checks."""


@pytest.fixture
def no_model_load(monkeypatch):
    calls = []

    def loader(*args, **kwargs):
        calls.append(args)
        raise LoaderReached

    for module in ("hf_cfp.cli.estimate", "hf_cfp.cli.diagnose"):
        monkeypatch.setattr(f"{module}.load_causal_lm", loader)
    return calls


@pytest.fixture
def inputs(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "2 + 2?"}\n{"text": "no prompt field"}\n')
    (tmp_path / "prompts.json").write_text('{"prompt": "a dict, not a list"}')
    (tmp_path / "empty.txt").write_text("\n\n")
    return tmp_path


def estimate(inputs, *extra):
    return ["estimate", "--model", str(inputs / "model"), "--output", str(inputs / "out"), *extra]


MISTAKES = {
    "missing prompts file": (["--prompts", "nope.jsonl"], "'nope.jsonl' is neither a bundled calibration set"),
    "prompts line without a prompt": (["--prompts", "{dir}/prompts.jsonl"], 'line 2: no "prompt" field'),
    "prompts .json not a list": (["--prompts", "{dir}/prompts.json"], "holds a JSON dict"),
    "prompts file without prompts": (["--prompts", "{dir}/empty.txt"], "holds no prompts"),
    "zero sequences": (["--num-sequences", "0"], "argument --num-sequences: must be an integer >= 1, got 0"),
    "negative batch size": (["--batch-size", "-4"], "argument --batch-size: must be an integer >= 1, got -4"),
    "batch size not a number": (["--batch-size", "eight"], "expected an integer >= 1, got 'eight'"),
    "top_p above 1": (["--top-p", "1.01"], "top_p must be in (0, 1], got 1.01"),
    "top_p zero": (["--top-p", "0"], "top_p must be in (0, 1], got 0.0"),
    "temperature zero": (["--temperature", "0"], "temperature must be > 0"),
    "top_k zero": (["--top-k", "0"], "top_k must be None or an integer >= 1"),
    "bad anchor name": (["--name", "../math"], "Anchor name '../math' is not allowed"),
    "output is a file": (["--output", "{dir}/a-file"], "--output '{dir}/a-file' is a file"),
    "output under a file": (["--output", "{dir}/a-file/anchor"], "is a file, so no directory can be made there"),
    "missing model": (["--model", "{dir}/no-model"], "--model '{dir}/no-model': no such file or directory"),
    "model directory without config": (["--model", "{dir}"], "is a directory without config.json"),
    "model file not gguf": (["--model", "{dir}/a-file"], "is a file but not a .gguf"),
    "bare model name": (["--model", "mymodel"], "'mymodel': no such file or directory; give a local model directory"),
    "unknown dtype": (["--dtype", "float8"], "argument --dtype: invalid choice: 'float8'"),
    "unknown device": (["--device", "gpu"], "--device 'gpu': Expected one of cpu, cuda"),
    "kfac rank without kfac": (["--kfac-rank", "8"], "--kfac-rank applies to --structure kfac"),
    "kfac rank zero": (["--structure", "kfac", "--kfac-rank", "0"], "argument --kfac-rank: must be an integer >= 1"),
    "kfac rank full without kfac": (["--kfac-rank", "full"], "--kfac-rank applies to --structure kfac"),
    "kfac rank neither a number nor full": (
        ["--structure", "kfac", "--kfac-rank", "all"],
        "argument --kfac-rank: expected an integer >= 1, got 'all' (or 'full': every eigenpair)",
    ),
    "unknown structure": (["--structure", "blocks"], "argument --structure: invalid choice: 'blocks'"),
    "kfac with the token estimator": (
        ["--structure", "kfac", "--estimator", "token"],
        "--structure: structure='kfac' pools each sequence's positions once",
    ),
}


@pytest.mark.parametrize("mistake", MISTAKES)
def test_estimate_refuses_a_mistake_before_loading_the_model(inputs, no_model_load, capsys, mistake):
    extra, message = MISTAKES[mistake]
    with pytest.raises(SystemExit) as exited:
        main(estimate(inputs, *(arg.format(dir=inputs) for arg in extra)))
    assert exited.value.code == 2
    assert message.format(dir=inputs) in capsys.readouterr().err
    assert no_model_load == [] and not (inputs / "out").exists()


def test_estimate_with_right_arguments_reaches_the_loader(inputs, no_model_load):
    (inputs / "good.txt").write_text("2 + 2?\n3 + 5?\n")
    with pytest.raises(LoaderReached):
        main(estimate(inputs, "--prompts", str(inputs / "good.txt"), "--top-p", "1", "--top-k", "5"))
    assert no_model_load == [(str(inputs / "model"),)]


RANKS = {  # flags -> estimate_fisher's structure and kfac_rank
    (): ("diagonal", None),
    ("--structure", "kfac"): ("kfac", None),
    ("--structure", "kfac", "--kfac-rank", "full"): ("kfac", None),
    ("--structure", "kfac", "--kfac-rank", "256"): ("kfac", 256),
}


@pytest.mark.parametrize("flags", RANKS)
def test_structure_and_kfac_rank_reach_estimate_fisher(inputs, monkeypatch, flags):
    received = []

    def estimate_fisher(*args, **kwargs):
        received.append((kwargs["structure"], kwargs["kfac_rank"]))
        raise LoaderReached

    monkeypatch.setattr("hf_cfp.cli.estimate.load_causal_lm", lambda *args, **kwargs: (None, None))
    monkeypatch.setattr("hf_cfp.cli.estimate.estimate_fisher", estimate_fisher)
    (inputs / "good.txt").write_text("2 + 2?\n")
    with pytest.raises(LoaderReached):
        main(estimate(inputs, "--prompts", str(inputs / "good.txt"), "--device", "cpu", *flags))
    assert received == [RANKS[flags]]


def test_cuda_without_a_gpu_is_refused_before_loading(inputs, no_model_load, capsys):
    if torch.cuda.is_available():
        pytest.skip("torch sees a CUDA device here")
    with pytest.raises(SystemExit) as exited:
        main(estimate(inputs, "--device", "cuda"))
    assert exited.value.code == 2 and "--device 'cuda': torch sees no CUDA device here" in capsys.readouterr().err
    assert no_model_load == []


PLACEMENTS = {  # flags -> what the loader gets on a machine without a GPU (dtype default: float32 off a GPU)
    (): {"dtype": "float32", "device": torch.device("cpu")},
    ("--dtype", "bfloat16"): {"dtype": "bfloat16", "device": torch.device("cpu")},
    ("--dtype", "auto", "--device", "cpu"): {"dtype": "auto", "device": torch.device("cpu")},
}


@pytest.mark.parametrize("flags", PLACEMENTS)
def test_dtype_and_device_reach_the_loader(inputs, monkeypatch, flags):
    if torch.cuda.is_available():
        pytest.skip("the defaults differ on a GPU")
    received = []

    def loader(model, **kwargs):
        received.append(kwargs)
        raise LoaderReached

    monkeypatch.setattr("hf_cfp.cli.estimate.load_causal_lm", loader)
    monkeypatch.setattr("hf_cfp.cli.diagnose.load_causal_lm", loader)
    (inputs / "good.txt").write_text("2 + 2?\n")
    FisherAnchor({"w": [1.0]}, name="math").save_pretrained(inputs / "anchor")
    diagnose = ["diagnose", "--anchor", str(inputs / "anchor")]
    for command in (estimate(inputs, "--prompts", str(inputs / "good.txt")), diagnose):
        with pytest.raises(LoaderReached):
            main([*command, "--model", str(inputs / "model"), *flags])
    assert received[0] == PLACEMENTS[flags] and received[1] == {**PLACEMENTS[flags], "local_files_only": False}


def test_diagnose_refuses_a_missing_data_file_before_loading(inputs, no_model_load, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["diagnose", "--anchor", "a", "--model", str(inputs / "model"), "--data", str(inputs / "pairs.jsonl")])
    assert exited.value.code == 2 and "is neither the bundled 'pirate_style' set" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["diagnose", "--anchor", "a", "--model", str(inputs / "model"), "--num-examples", "0"])
    assert exited.value.code == 2 and no_model_load == []
