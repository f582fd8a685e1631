"""`hf-cfp train {sft,dpo,grpo} --config` end to end, on the example YAMLs in scripts/configs/ with a tiny local model.

Each run takes its trainer's example YAML (run from the repository root, so its bundled dataset path resolves) and
overrides on the command line what a test must: the model (a tiny Llama saved to a directory with its tokenizer),
the anchor (a directory), the output directory, 3 steps on the CPU, and `--cfp_lam 7.5` against the YAML's 200.
The cfp/* metrics in `trainer_state.json` at the last step are checked against float64 references recomputed here
from the saved model's weights and the initial weights (`support.references.drift_reference`), the logged lam
against the command line's value, and for SFT the TensorBoard event files against the log history. Bad values are
errors naming the field, raised before the model loads: the model path given with them does not exist.
"""

import json
import math
from pathlib import Path

import pytest
from safetensors.torch import load_file
from support.extras import needs
from support.references import drift_reference
from support.tensorboard import read_scalars
from support.tiny import accelerate_launch, anchor_for, tiny_llama, tiny_tokenizer

needs("trl", "datasets")

from hf_cfp import FisherAnchor  # noqa: E402
from hf_cfp.anchor.fingerprint import model_fingerprint  # noqa: E402
from hf_cfp.cli import main  # noqa: E402
from hf_cfp.errors import CFPArgumentError  # noqa: E402
from hf_cfp.launch.train import parse_train_arguments, train_main  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
STEPS = 3
LAM = 7.5  # the YAMLs say 200: the command line must win
CFP_KEYS = ("cfp/math/sensitive_drift", "cfp/math/free_drift", "cfp/math/predicted_kl", "cfp/total_drift")
# float32 metrics against float64 references: 2e-8..5e-8 relative seen in tests/integration/test_trainers.py
METRIC_REL = 1e-5


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A tiny Llama and its tokenizer saved to `model/`, its float64 initial weights, and an anchor over every
    parameter (uniform random F, with the model's fingerprint) saved to `anchor/`."""
    root = tmp_path_factory.mktemp("train-cli")
    tokenizer = tiny_tokenizer()
    model = tiny_llama(vocab_size=len(tokenizer), hidden_size=16, seed=0, eos_token_id=tokenizer.eos_token_id)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    anchor = anchor_for(model, name="math", seed=1)
    anchor.metadata["base_fingerprint"] = model_fingerprint(model)
    anchor.save_pretrained(root / "anchor")
    weights = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    return {"root": root, "model": str(root / "model"), "anchor": str(root / "anchor"), "weights": weights}


def example_arguments(kind, workspace, output_dir, *more):
    """`hf-cfp train <kind>` on scripts/configs/<kind>.yaml, with the tiny model, the anchor, 3 CPU steps."""
    arguments = [kind, "--config", f"scripts/configs/{kind}.yaml", "--model_name_or_path", workspace["model"]]
    arguments += ["--cfp_anchor", workspace["anchor"], "--output_dir", str(output_dir), "--max_steps", str(STEPS)]
    arguments += ["--use_cpu", "--disable_tqdm", "true", "--learning_rate", "1e-2", "--seed", "0"]
    return arguments + [str(m) for m in more]


EXTRA = {
    "sft": ["--report_to", "tensorboard"],
    "dpo": ["--report_to", "none"],
    # rewards by length: completions of random tokens differ in length (last_number_matches would give all zeros)
    "grpo": ["--report_to", "none", "--reward_funcs", "brevity", "--max_completion_length", "8"],
}


@pytest.mark.parametrize("kind", ["sft", "dpo", "grpo"])
def test_example_config_trains_and_logs_the_drift_of_the_saved_model(kind, workspace, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # the YAMLs name their datasets relative to the repository root
    output_dir = tmp_path / kind
    main(["train", *example_arguments(kind, workspace, output_dir, "--cfp_lam", LAM, *EXTRA[kind])])

    history = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
    logs = [h for h in history if "loss" in h]
    assert [h["step"] for h in logs] == list(range(1, STEPS + 1))
    for h in logs:  # every logged step, with the command line's lam
        assert h["cfp/math/lam"] == LAM, h
        assert all(math.isfinite(h[key]) for key in CFP_KEYS), h

    reference = check_last_metrics_against_the_saved_model(kind, output_dir, logs[-1], workspace)

    assert "cfp" not in json.loads((output_dir / "config.json").read_text())  # the saved model's config untouched
    trace = json.loads((output_dir / "cfp_provenance.json").read_text())  # the trace beside the saved model
    assert trace["lam"] == [LAM]
    assert [a["name"] for a in trace["anchors"]] == ["math"]
    assert trace["final_metrics"]["cfp/total_drift"] == pytest.approx(reference["cfp/total_drift"], rel=METRIC_REL)

    if kind == "sft":  # the reporter received the same numbers on the same steps
        scalars = read_scalars(output_dir)
        for key in CFP_KEYS:
            logged = [(h["step"], h[key]) for h in logs]
            received = scalars[f"train/{key}"]
            assert [s for s, _ in received] == [s for s, _ in logged], key
            for (_, got), (_, want) in zip(received, logged, strict=True):
                assert got == pytest.approx(want, rel=1e-6), (key, got, want)


def check_last_metrics_against_the_saved_model(kind, output_dir, last, workspace):
    """The cfp/* metrics logged at the last step equal float64 drift of the saved model from the initial weights;
    returns that reference."""
    saved = load_file(output_dir / "model.safetensors")
    initial = workspace["weights"]
    assert saved.keys() == initial.keys()
    deltas = {n: saved[n].double() - initial[n] for n in initial}
    fisher = FisherAnchor.from_pretrained(workspace["anchor"]).fisher
    reference = drift_reference(deltas, fisher, "math")
    for key, value in reference.items():
        print(f"{kind} {key}: logged {last[key]:.6e}, float64 from the saved model {value:.6e}")
        assert value > 0, key  # the run moved the weights
        assert last[key] == pytest.approx(value, rel=METRIC_REL), (key, last[key], value)
    return reference


def test_the_same_command_under_accelerate_launch_trains_on_two_processes(workspace, tmp_path):
    """`accelerate launch --config_file scripts/accelerate/ddp.yaml -m hf_cfp.cli train sft ...` (the README's
    command; ACCELERATE_USE_CPU=true: 2 gloo processes, `--mixed_precision no` as in test_accelerate_launch). The
    16 bundled pairs at 4 per device make 2 steps per epoch on 2 processes (4 on one), so the epoch logged at
    step 1 shows the process count; the main process's saved model and log agree as in one process."""
    output_dir = tmp_path / "launched"
    arguments = example_arguments("sft", workspace, output_dir, "--cfp_lam", LAM, "--report_to", "none")
    arguments[arguments.index("--config") + 1] = str(REPO / "scripts" / "configs" / "sft.yaml")
    arguments += ["--dataset_name", str(REPO / "hf_cfp" / "loading" / "data" / "pirate_style.jsonl")]
    run = accelerate_launch(
        "hf_cfp.cli",
        "train",
        *arguments,
        config_file=REPO / "scripts" / "accelerate" / "ddp.yaml",
        launch_args=["--mixed_precision", "no", "-m"],
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    history = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
    logs = [h for h in history if "loss" in h]
    assert [h["step"] for h in logs] == list(range(1, STEPS + 1))
    assert logs[0]["epoch"] == pytest.approx(1 / math.ceil(16 / (4 * 2)))  # 0.5: two processes of 4 rows
    assert all(h["cfp/math/lam"] == LAM for h in logs)
    check_last_metrics_against_the_saved_model("sft under accelerate launch", output_dir, logs[-1], workspace)


def test_yaml_values_hold_where_the_command_line_is_silent(workspace, tmp_path, monkeypatch):
    """A YAML of our own: its cfp_lam and max_steps are used when no flag overrides them."""
    monkeypatch.chdir(REPO)
    config = tmp_path / "cfg.yaml"
    config.write_text(
        f"model_name_or_path: {workspace['model']}\ndataset_name: hf_cfp/loading/data/pirate_style.jsonl\n"
        f"output_dir: {tmp_path / 'out'}\nmax_steps: 2\nper_device_train_batch_size: 2\nmax_length: 32\n"
        "logging_steps: 1\nsave_strategy: 'no'\nreport_to: none\nuse_cpu: true\nbf16: false\n"
        f"cfp_anchor: {workspace['anchor']}\ncfp_lam: 3.25\ncfp_free_fraction: 0.9\n"
    )
    trainer = train_main(["sft", "--config", str(config), "--disable_tqdm", "true"])
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["step"] for h in logs] == [1, 2]
    assert [h["cfp/math/lam"] for h in logs] == [3.25, 3.25]
    params = {n: p.detach().double() for n, p in trainer.model.named_parameters()}
    deltas = {n: params[n] - workspace["weights"][n] for n in params}
    fisher = FisherAnchor.from_pretrained(workspace["anchor"]).fisher
    free = drift_reference(deltas, fisher, "math", free_fraction=0.9)["cfp/math/free_drift"]
    assert logs[-1]["cfp/math/free_drift"] == pytest.approx(free, rel=METRIC_REL)  # the YAML's free_fraction


BAD_VALUES = [
    ("sft", ["--cfp_lam", "-1"], "cfp_lam must be finite and >= 0"),
    ("dpo", ["--cfp_free_fraction", "1.5"], "cfp_free_fraction must be in (0, 1)"),
    ("sft", ["--cfp_anchor", "./no/such/anchor"], "cfp_anchor: no anchor directory at './no/such/anchor'"),
    ("sft", ["--cfp_predicted_kl_budget", "0.1"], "Pass cfp_lam or cfp_predicted_kl_budget, not both"),
    ("dpo", ["--cfp_sparse", "1.0"], "cfp_sparse must be None (dense) or a share in (0, 1)"),
    ("sft", ["--dataset_name", "no/such/data.jsonl"], "dataset_name: no file at 'no/such/data.jsonl'"),
    ("grpo", ["--reward_funcs", "no_such_reward"], "reward_funcs: cannot load 'no_such_reward'"),
]


@pytest.mark.parametrize(("kind", "flags", "message"), BAD_VALUES)
def test_bad_values_are_errors_naming_the_field_before_the_model_loads(
    kind, flags, message, workspace, tmp_path, monkeypatch
):
    monkeypatch.chdir(REPO)
    arguments = example_arguments(kind, workspace, tmp_path / "out", *flags)
    arguments[arguments.index("--model_name_or_path") + 1] = str(tmp_path / "no-model-here")  # never reached
    with pytest.raises(CFPArgumentError) as caught:
        train_main(arguments)
    assert message in str(caught.value)
    assert not (tmp_path / "out").exists()  # nothing was trained or written


def test_command_line_reports_a_bad_value_and_exits_2(workspace, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    arguments = example_arguments("dpo", workspace, tmp_path / "out", "--cfp_lam", "-2")
    with pytest.raises(SystemExit) as exited:
        main(["train", *arguments])
    assert exited.value.code == 2  # a usage error (hf_cfp.cli.failures)
    assert "hf-cfp train: error: cfp_lam must be finite and >= 0" in capsys.readouterr().err


def test_train_needs_a_known_trainer():
    with pytest.raises(CFPArgumentError, match=r"one of \['dpo', 'grpo', 'sft'\], got \['ppo'\]"):
        train_main(["ppo", "--config", "scripts/configs/dpo.yaml"])


def test_example_configs_parse_and_name_existing_files(workspace, monkeypatch):
    """Every key of the example YAMLs is known to the parser, and their datasets ship with the package."""
    monkeypatch.chdir(REPO)
    for kind in ("sft", "dpo", "grpo"):
        _, script_args, training_args, model_args, cfp_config = parse_train_arguments(
            [kind, "--config", f"scripts/configs/{kind}.yaml", "--cfp_anchor", workspace["anchor"]]
        )
        assert model_args.model_name_or_path == "smollm2-135m"
        assert Path(script_args.dataset_name).is_file()
        assert cfp_config.cfp_lam == [200.0] and training_args.logging_steps == 1
