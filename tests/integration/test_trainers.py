"""CFPCallback inside real trainers: transformers.Trainer, TRL DPOTrainer and GRPOTrainer.

Everything runs on CPU with tiny Llamas built in memory. Logged drift metrics are checked
against references computed here from the final weights and a theta0 copy taken before
training; TensorBoard event files are read back to check the metrics reached the reporter.
The Trainer's path is checked against `ReferenceCFP` (tests/support/references.py), the formula
applied one parameter at a time; lam = 0 is bit-identical to no callback.
"""

import copy
import json
import math

import pytest
import torch
from support.anchors import random_anchor
from support.extras import requires
from support.references import ReferenceCFP
from support.tensorboard import read_scalars
from support.tiny import tiny_llama, tiny_tokenizer
from support.training import QUIET_CPU_RUN, lm_dataset, train
from transformers import Trainer, TrainingArguments
from transformers.integrations import TensorBoardCallback

from hf_cfp import CFPCallback, FisherAnchor

SENS, FREE, TOTAL = "cfp/math/sensitive_drift", "cfp/math/free_drift", "cfp/total_drift"
MON_SENS, MON_FREE = "cfp/code/sensitive_drift", "cfp/code/free_drift"
CFP_KEYS = (SENS, FREE, TOTAL, MON_SENS, MON_FREE)


# ---------------------------------------------------------------- helpers and references


def random_fisher(model, seed, keep=lambda name: True):
    """name -> F over the kept trainable params: a random permutation of distinct values in (0.01, 1.01]."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {n: p.shape for n, p in model.named_parameters() if p.requires_grad and keep(n)}
    sizes = [math.prod(s) for s in shapes.values()]
    flat = 0.01 + (torch.randperm(sum(sizes), generator=gen, dtype=torch.float64) + 1) / sum(sizes)
    return {n: t.float().reshape(shapes[n]) for n, t in zip(shapes, flat.split(sizes), strict=True)}


def snapshot(model):
    return {name: p.detach().double().clone() for name, p in model.named_parameters()}


def deltas(model, theta0, names):
    params = dict(model.named_parameters())
    return {n: params[n].detach().double() - theta0[n] for n in names}


def ref_sensitive(model, theta0, fisher):
    """sqrt(sum_i F_i Delta_i^2), a plain float64 sum."""
    d = deltas(model, theta0, fisher)
    return math.sqrt(sum(float((fisher[n].double() * d[n] ** 2).sum()) for n in fisher))


def ref_free(model, theta0, fisher, fraction=0.99):
    """||Delta|| over the ceil(fraction * n) coordinates with the smallest F (F values distinct)."""
    d = deltas(model, theta0, fisher)
    f = torch.cat([fisher[n].double().reshape(-1) for n in fisher])
    dd = torch.cat([d[n].reshape(-1) for n in fisher])
    assert torch.unique(f).numel() == f.numel(), "the reference needs distinct F values"
    k = math.ceil(fraction * f.numel())
    order = torch.argsort(f)[:k]
    return float(dd[order].norm())


def ref_total(model, theta0, names):
    d = deltas(model, theta0, names)
    return math.sqrt(sum(float((d[n] ** 2).sum()) for n in names))


# The logged metrics are float32 sums: theta - theta0 in float32 (relative error <= 2^-24 per coordinate),
# then a float32 norm per tensor (at most a few thousand terms here; the float64 squares of those norms
# are added). The differences seen against the float64 references are 2e-8 to 5e-8 of the value, so
# rel = 1e-5 leaves a 200x margin. Taking a monitor's free-drift threshold from another anchor's F
# moved its free drift by 3e-3 (DPO) and 6e-4 (GRPO) of its value.
METRIC_REL = 1e-5


def assert_monitor_matches_reference(logged, model, theta0, monitor_fisher):
    """The monitor anchor's logged sensitive and free drift against the float64 references."""
    refs = {MON_SENS: ref_sensitive(model, theta0, monitor_fisher), MON_FREE: ref_free(model, theta0, monitor_fisher)}
    for key, ref in refs.items():
        print(f"{key}: logged {logged[key]!r}, float64 {ref!r}, relative difference {logged[key] / ref - 1:+.2e}")
        assert logged[key] == pytest.approx(ref, rel=METRIC_REL), (key, logged[key], ref)
    # the free 99% leave the monitor's largest F out: below its drift over all its coordinates
    assert 0 < refs[MON_FREE] < ref_total(model, theta0, list(monitor_fisher))


def loss_logs(trainer):
    return [h for h in trainer.state.log_history if "loss" in h]


def assert_cfp_in_every_loss_log(trainer, keys=CFP_KEYS):
    history = trainer.state.log_history
    logs = loss_logs(trainer)
    assert logs, f"no training loss was logged: {history}"
    for h in logs:
        missing = [k for k in keys if k not in h]
        assert not missing, f"step {h.get('step')}: {missing} missing from {h}"
        for k in keys:
            assert math.isfinite(h[k]) and h[k] >= 0, (k, h[k])
    # and only there: no other history entry (train summary, ...) got them
    for h in history:
        if "loss" not in h:
            assert not any(k in h for k in keys), h
    return logs


# ---------------------------------------------------------------- transformers.Trainer


def _random_lm_dataset(vocab, n=8, length=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (length,), generator=gen)
        rows.append({"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)})
    return rows


def test_trainer_metrics_reach_tensorboard_and_history_and_match_reference(tmp_path, monkeypatch):
    tb_dir = tmp_path / "tb"
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tb_dir))
    model = tiny_llama(vocab_size=32, hidden_size=16)
    fisher = random_fisher(model, seed=1)
    monitor_fisher = random_fisher(model, seed=2, keep=lambda n: "mlp" in n)  # a subset of the params
    anchor = FisherAnchor(fisher=fisher, name="math")
    monitor = FisherAnchor(fisher=monitor_fisher, name="code")
    theta0 = snapshot(model)
    callback = CFPCallback(anchor, lam=1.0, monitor=[monitor])

    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        report_to=["tensorboard"],
        logging_steps=2,
        max_steps=6,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=_random_lm_dataset(32), callbacks=[callback])
    trainer.train()

    # 1. log_history: cfp keys in every loss log, at the loss logs' steps
    logs = assert_cfp_in_every_loss_log(trainer)
    assert [h["step"] for h in logs] == [2, 4, 6]
    for h in logs:
        assert h[SENS] > 0 and h[FREE] > 0 and h[TOTAL] > 0 and h[MON_SENS] > 0 and h[MON_FREE] > 0

    # 2. the last log is at the final step: compare with references from the final weights
    last = logs[-1]
    assert last["step"] == trainer.state.global_step == 6
    all_names = list(fisher)  # the protecting anchor covers every trainable parameter
    refs = {
        SENS: ref_sensitive(model, theta0, fisher),
        FREE: ref_free(model, theta0, fisher),
        TOTAL: ref_total(model, theta0, all_names),
        MON_SENS: ref_sensitive(model, theta0, monitor_fisher),
        MON_FREE: ref_free(model, theta0, monitor_fisher),
    }
    for key, ref in refs.items():
        assert last[key] == pytest.approx(ref, rel=1e-5), (key, last[key], ref)
    # sanity of the references: the free 99% exclude the top 1% of F, so they sit below the total
    assert refs[FREE] < refs[TOTAL] and refs[MON_FREE] < refs[TOTAL]

    # 3. TensorBoard: the same metrics at exactly the steps of train/loss, with the same values
    scalars = read_scalars(tb_dir)
    loss_steps = [s for s, _ in scalars["train/loss"]]
    assert loss_steps == [2, 4, 6]
    for key in CFP_KEYS:
        tag = f"train/{key}"
        assert tag in scalars, f"{tag} not in {sorted(scalars)}"
        assert [s for s, _ in scalars[tag]] == loss_steps
        for (step, value), h in zip(scalars[tag], logs, strict=True):
            assert step == h["step"]
            assert value == pytest.approx(h[key], rel=1e-6)
            assert math.isfinite(value) and value > 0

    # 4. placement: the user passed only callbacks=[...]; the handler now has CFP before TensorBoard
    callbacks = trainer.callback_handler.callbacks
    kinds = [type(cb).__name__ for cb in callbacks]
    i_cfp = next(i for i, cb in enumerate(callbacks) if cb is callback)
    i_tb = next(i for i, cb in enumerate(callbacks) if isinstance(cb, TensorBoardCallback))
    assert i_cfp < i_tb, kinds
    assert sum(cb is callback for cb in callbacks) == 1, kinds


# ---------------------------------------------------------------- transformers.Trainer vs ReferenceCFP


@pytest.mark.parametrize("lam", [10.0, lambda step: 0.5 * step])
def test_callback_matches_per_parameter_reference(tmp_path, lam):
    base = tiny_llama()
    anchor = random_anchor(base)
    ours = train(copy.deepcopy(base), [CFPCallback(anchor, lam=lam)], tmp_path / "ours")
    reference = train(copy.deepcopy(base), [ReferenceCFP(anchor.fisher, lam)], tmp_path / "ref")
    plain = train(copy.deepcopy(base), [], tmp_path / "plain")
    diff = max((ours[n] - reference[n]).abs().max().item() for n in ours)
    effect = max((ours[n] - plain[n]).abs().max().item() for n in ours)
    assert diff <= 1e-6
    assert effect > 1e-3, "the correction must change the run by far more than the tolerance"


@pytest.mark.parametrize("fisher_dtype", ["float32", "bfloat16"])
def test_memory_plans_follow_the_reference_path(tmp_path, fisher_dtype):
    """Dense with F in bf16: the reference run with F rounded to bf16. Sparse (top 10% of coordinates): the
    reference with F zeroed below the 90th percentile, found by sorting every value; the logged metrics, over
    theta0 and F offloaded, are those of the full anchor."""
    base = tiny_llama()
    anchor = random_anchor(base)
    stored = {n: f.to(getattr(torch, fisher_dtype)).float() for n, f in anchor.fisher.items()}
    ours = train(copy.deepcopy(base), [CFPCallback(anchor, lam=10.0, fisher_dtype=fisher_dtype)], tmp_path / "o")
    reference = train(copy.deepcopy(base), [ReferenceCFP(stored, 10.0)], tmp_path / "r")
    assert max((ours[n] - reference[n]).abs().max().item() for n in ours) <= 1e-6

    values = torch.cat([f.reshape(-1) for f in anchor.fisher.values()]).sort().values
    threshold = values[math.ceil(0.9 * values.numel()) - 1]
    top = {n: torch.where(f > threshold, f, 0.0) for n, f in anchor.fisher.items()}
    sparse = CFPCallback(anchor, lam=10.0, sparse=0.1)
    ours = train(copy.deepcopy(base), [sparse], tmp_path / "s")
    reference = train(copy.deepcopy(base), [ReferenceCFP(top, 10.0)], tmp_path / "t")
    plain = train(copy.deepcopy(base), [], tmp_path / "p")
    assert max((ours[n] - reference[n]).abs().max().item() for n in ours) <= 1e-6
    assert max((ours[n] - plain[n]).abs().max().item() for n in ours) > 1e-3  # the kept 10% do move
    assert sparse.protection.sparse_report.kept == sum(int((f > 0).sum()) for f in top.values())


def test_lam_zero_is_bit_identical_to_no_callback(tmp_path):
    base = tiny_llama()
    ours = train(copy.deepcopy(base), [CFPCallback(random_anchor(base), lam=0.0)], tmp_path / "a")
    plain = train(copy.deepcopy(base), [], tmp_path / "b")
    assert all(torch.equal(ours[n], plain[n]) for n in ours)


def test_a_reused_callback_binds_to_the_new_model(tmp_path):
    """One callback instance passed to two trainers must protect (and measure) the second model."""
    first, second = tiny_llama(seed=0), tiny_llama(seed=1)
    ones = FisherAnchor({n: torch.ones(p.shape) for n, p in first.named_parameters()}, name="all")
    callback = CFPCallback(ones, lam=1e6)
    train(first, [callback], tmp_path / "first", steps=2)
    theta0 = {n: p.detach().clone() for n, p in second.named_parameters()}
    final = train(second, [callback], tmp_path / "second", steps=2)
    assert callback.protection.model is second
    moved = max((final[n] - theta0[n]).abs().max().item() for n in final)
    assert moved < 1e-6  # lam F = 1e6: every coordinate pinned to the second model's theta0


# ---------------------------------------------------------------- TRL DPOTrainer


def _preference_dataset():
    from datasets import Dataset

    rows = {
        "prompt": [
            "what is two plus three",
            "print the sum",
            "what is the answer",
            "two plus two is",
            "code the sum",
            "what is five",
            "print two",
            "the answer is",
        ],
        "chosen": [" five", " print sum", " five", " four", " sum code", " five is five", " two", " five"],
        "rejected": [" three", " the code", " two plus", " three plus", " what", " two", " three three", " what is"],
    }
    return Dataset.from_dict(rows)


def _run_dpo(tmp_path, tokenizer, tag, callbacks=(), report_to="none"):
    """3 DPO steps from the same seed-0 tiny Llama (activation_checkpointing is transformers 5's name
    for gradient_checkpointing, which TRL turns on by default)."""
    from trl import DPOConfig, DPOTrainer

    model = tiny_llama(vocab_size=len(tokenizer), hidden_size=16, seed=0)
    theta0 = snapshot(model)
    args = DPOConfig(
        output_dir=str(tmp_path / tag),
        use_cpu=True,
        bf16=False,
        activation_checkpointing=False,
        logging_steps=1,
        max_steps=3,
        report_to=report_to,
        per_device_train_batch_size=2,
        max_length=32,
        learning_rate=1e-2,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    trainer = DPOTrainer(
        model=model,
        ref_model=copy.deepcopy(model),
        args=args,
        train_dataset=_preference_dataset(),
        processing_class=tokenizer,
        callbacks=list(callbacks),
    )
    trainer.train()
    return trainer, model, theta0


@requires("trl", "datasets")
def test_dpo_trainer_correction_acts_and_metrics_logged(tmp_path, monkeypatch):
    tokenizer = tiny_tokenizer()
    probe = tiny_llama(vocab_size=len(tokenizer), hidden_size=16, seed=0)
    assert probe.config.vocab_size >= len(tokenizer)
    fisher = random_fisher(probe, seed=3)
    monitor_fisher = random_fisher(probe, seed=4, keep=lambda n: "self_attn" in n)
    anchor = FisherAnchor(fisher=fisher, name="math")
    monitor = FisherAnchor(fisher=monitor_fisher, name="code")

    tb_dir = tmp_path / "tb"
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tb_dir))
    strong = CFPCallback(anchor, lam=1e3, monitor=[monitor])
    trainer, model, theta0 = _run_dpo(tmp_path, tokenizer, "strong", [strong], report_to=["tensorboard"])
    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR")
    base_trainer, base_model, base_theta0 = _run_dpo(tmp_path, tokenizer, "base")
    off_trainer, off_model, _ = _run_dpo(tmp_path, tokenizer, "off", [CFPCallback(anchor, lam=0.0)])

    for name in theta0:
        torch.testing.assert_close(theta0[name], base_theta0[name], rtol=0, atol=0)

    # metrics at every loss log (steps 1, 2, 3), equal to the references at the final step
    logs = assert_cfp_in_every_loss_log(trainer)
    assert [h["step"] for h in logs] == [1, 2, 3]
    last = logs[-1]
    assert last[SENS] == pytest.approx(ref_sensitive(model, theta0, fisher), rel=1e-5)
    assert last[FREE] == pytest.approx(ref_free(model, theta0, fisher), rel=1e-5)
    assert last[TOTAL] == pytest.approx(ref_total(model, theta0, list(fisher)), rel=1e-5)
    assert_monitor_matches_reference(last, model, theta0, monitor_fisher)
    scalars = read_scalars(tb_dir)
    loss_steps = [s for s, _ in scalars["train/loss"]]
    assert loss_steps == [1, 2, 3]
    for key in CFP_KEYS:
        assert [s for s, _ in scalars[f"train/{key}"]] == loss_steps, key

    # lam = 0: metrics logged, training untouched (bit-identical to the run without a callback)
    assert_cfp_in_every_loss_log(off_trainer, keys=(SENS, FREE, TOTAL))
    for (name, p), (_, q) in zip(base_model.named_parameters(), off_model.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    assert loss_logs(off_trainer)[-1][SENS] == pytest.approx(ref_sensitive(base_model, theta0, fisher), rel=1e-5)

    # the correction acted: other parameters, far less sensitive drift, than without it
    base_sens = ref_sensitive(base_model, theta0, fisher)
    strong_sens = ref_sensitive(model, theta0, fisher)
    assert base_sens > 0
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), base_model.parameters(), strict=True))
    assert strong_sens < 0.1 * base_sens, (strong_sens, base_sens)


# ---------------------------------------------------------------- TRL GRPOTrainer


def _reward_letters(completions, **kwargs):
    """Reward the number of 'e' characters plus a small length term."""
    return [float(c.count("e")) + 0.1 * len(c) for c in completions]


@requires("trl", "datasets")
def test_grpo_trainer_logs_metrics_to_tensorboard(tmp_path, monkeypatch):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = tiny_tokenizer()
    model = tiny_llama(vocab_size=len(tokenizer), hidden_size=16, seed=0, eos_token_id=tokenizer.eos_token_id)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    fisher = random_fisher(model, seed=5)
    monitor_fisher = random_fisher(model, seed=6, keep=lambda n: "mlp" in n)
    theta0 = snapshot(model)
    callback = CFPCallback(
        FisherAnchor(fisher=fisher, name="math"), lam=1.0, monitor=[FisherAnchor(fisher=monitor_fisher, name="code")]
    )

    tb_dir = tmp_path / "tb"
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tb_dir))
    prompts = ["what is two plus three", "print the sum", "the answer is", "code the sum"] * 2
    args = GRPOConfig(
        output_dir=str(tmp_path / "grpo"),
        use_cpu=True,
        bf16=False,
        activation_checkpointing=False,
        logging_steps=1,
        max_steps=2,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=8,
        report_to=["tensorboard"],
        learning_rate=1e-2,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=_reward_letters,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
        callbacks=[callback],
    )
    trainer.train()

    logs = assert_cfp_in_every_loss_log(trainer)
    assert [h["step"] for h in logs] == [1, 2]
    last = logs[-1]
    assert last[SENS] == pytest.approx(ref_sensitive(model, theta0, fisher), rel=1e-5)
    assert last[FREE] == pytest.approx(ref_free(model, theta0, fisher), rel=1e-5)
    assert last[TOTAL] == pytest.approx(ref_total(model, theta0, list(fisher)), rel=1e-5)
    assert_monitor_matches_reference(last, model, theta0, monitor_fisher)
    assert last[TOTAL] > 0, "the rewards gave no signal: nothing moved"

    scalars = read_scalars(tb_dir)
    loss_steps = [s for s, _ in scalars["train/loss"]]
    assert loss_steps == [1, 2]
    for key in CFP_KEYS:
        assert [s for s, _ in scalars[f"train/{key}"]] == loss_steps, key
    assert "train/reward" in scalars  # TRL's own metrics share the same step log
    callbacks = trainer.callback_handler.callbacks
    assert callbacks.index(callback) < next(i for i, cb in enumerate(callbacks) if isinstance(cb, TensorBoardCallback))


def test_the_trained_model_carries_the_cfp_trace_and_its_config_is_untouched(tmp_path):
    """Tags for the Hub card (`cfp`, `cfp-anchor:<name>`), and output_dir's cfp_provenance.json: the anchor, lam and
    the final drift, equal to the metrics the last logging step recorded in trainer_state.json; the saved
    config.json has no `cfp` entry."""
    model = tiny_llama()
    anchor = random_anchor(model)
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, **{**QUIET_CPU_RUN, "logging_steps": 3}
    )
    trainer = Trainer(model=model, args=args, train_dataset=lm_dataset(), callbacks=[CFPCallback(anchor, lam=10.0)])
    trainer.train()
    assert {"cfp", "cfp-anchor:math"} <= set(model.model_tags)
    trainer.create_model_card(tags=list(model.model_tags))  # what Trainer.push_to_hub does with the model's tags
    card = (tmp_path / "README.md").read_text()
    assert "- cfp\n" in card and "- cfp-anchor:math\n" in card
    trainer.save_model(str(tmp_path / "final"))
    assert "cfp" not in json.loads((tmp_path / "final" / "config.json").read_text())
    assert not hasattr(model.config, "cfp")
    trace = json.loads((tmp_path / "cfp_provenance.json").read_text())  # beside the model save_model() writes
    assert trace["anchors"] == [{"name": "math", "reference": None}] and trace["lam"] == [10.0]
    assert trace["global_step"] == 3
    logged = [h for h in trainer.state.log_history if "cfp/total_drift" in h][-1]
    assert trace["final_metrics"]["cfp/total_drift"] == pytest.approx(logged["cfp/total_drift"], rel=1e-6)
    assert trace["final_metrics"]["cfp/math/sensitive_drift"] > 0
