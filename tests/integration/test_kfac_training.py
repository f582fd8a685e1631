"""K-FAC anchors through the Trainer, the loop API and the Hub: a run resumed from a checkpoint is bit-identical to
the uninterrupted one, kl_budget holds the predicted KL of the K-FAC quadratic, the loop API's state_dict resumes
bit for bit, an anchor pushed to a (local) Hub comes back with its factors and protects, and TRL's DPO runs with
it."""

import copy

import pytest
import torch
from support.extras import needs
from support.tiny import tiny_llama, tiny_tokenizer
from support.training import lm_dataset
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_cfp import CFP, CFPCallback, FisherAnchor, estimate_fisher
from hf_cfp.names import LAM, PREDICTED_KL


def kfac_anchor(model, name="math"):
    return estimate_fisher(
        model,
        None,
        [[1, 2, 3], [4, 5, 6]],
        num_sequences=6,
        max_new_tokens=4,
        batch_size=3,
        seed=0,
        structure="kfac",
        show_progress=False,
        name=name,
    )


class Crash(TrainerCallback):
    def on_save(self, args, state, control, **kwargs):
        if state.global_step == 4:
            raise KeyboardInterrupt("simulated crash")


def run(output_dir, anchor_dir, extra=(), resume=None, **callback_kwargs):
    model = tiny_llama()
    args = TrainingArguments(
        output_dir=str(output_dir),
        max_steps=6,
        save_steps=2,
        per_device_train_batch_size=4,
        learning_rate=3e-2,
        use_cpu=True,
        report_to="none",
        logging_steps=1,
        seed=0,
        disable_tqdm=True,
    )
    cfp = CFPCallback(str(anchor_dir), **callback_kwargs)
    trainer = Trainer(model=model, args=args, train_dataset=lm_dataset(), callbacks=[cfp, *extra])
    trainer.train(resume_from_checkpoint=resume)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, trainer.state.log_history


@pytest.fixture(scope="module")
def anchor_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("kfac")
    kfac_anchor(tiny_llama()).save_pretrained(directory)
    return directory


def test_a_resumed_run_is_bit_identical(anchor_dir, tmp_path):
    straight, _ = run(tmp_path / "straight", anchor_dir, lam=lambda step: 50.0 * step)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "crashed", anchor_dir, extra=[Crash()], lam=lambda step: 50.0 * step)
    resumed, _ = run(tmp_path / "crashed", anchor_dir, resume=True, lam=lambda step: 50.0 * step)
    plain, _ = run(tmp_path / "plain", anchor_dir, lam=0.0)
    assert all(torch.equal(resumed[n], straight[n]) for n in straight)
    assert max((straight[n] - plain[n]).abs().max().item() for n in plain) > 1e-3  # the correction acted


def test_kl_budget_holds_the_kfac_prediction_at_every_step(anchor_dir, tmp_path):
    _, logs = run(tmp_path / "budget", anchor_dir, kl_budget=1e-3)
    steps = [row for row in logs if PREDICTED_KL.key("math") in row]
    assert len(steps) == 6
    assert all(row[PREDICTED_KL.key("math")] <= 1e-3 * (1 + 1e-6) for row in steps)
    assert any(row[LAM.key("math")] > 0 for row in steps)  # the budget was reached and held by a pull


def test_loop_api_state_dict_resumes_bit_for_bit(anchor_dir):
    def steps(model, protector, optimizer, count):
        ids = torch.randint(0, 32, (4, 10), generator=torch.Generator().manual_seed(count))
        for _ in range(count):
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            protector.step()

    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
    protector = CFP(model, str(anchor_dir), lam=100.0, optimizer=optimizer)
    steps(model, protector, optimizer, 2)
    saved = (
        protector.state_dict(),
        {n: p.detach().clone() for n, p in model.named_parameters()},
        copy.deepcopy(optimizer.state_dict()),
    )  # the optimizer's state tensors change in place
    steps(model, protector, optimizer, 2)
    straight = {n: p.detach().clone() for n, p in model.named_parameters()}

    model = tiny_llama()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(saved[1][n])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
    optimizer.load_state_dict(saved[2])
    resumed = CFP(model, str(anchor_dir), lam=100.0, optimizer=optimizer)
    resumed.load_state_dict(saved[0])
    steps(model, resumed, optimizer, 2)
    assert all(torch.equal(p, straight[n]) for n, p in model.named_parameters())


def test_pushed_and_pulled_from_the_hub_it_protects_as_the_original(local_hub, tmp_path):
    model = tiny_llama()
    anchor = kfac_anchor(model)
    anchor.push_to_hub("org/anchors")
    files = local_hub.files("org/anchors")
    assert "Kronecker-factored (K-FAC)" in files["cfp/math/README.md"].decode()
    pulled = FisherAnchor.from_pretrained("org/anchors:cfp/math", cache_dir=tmp_path, lazy=True)
    assert pulled.structure == "kfac" and sorted(pulled.kfac_names) == sorted(anchor.kfac_names)
    for name in anchor.kfac_names:
        for got, want in zip(pulled.kfac_factors(name), anchor.kfac_factors(name), strict=True):
            assert torch.equal(got, want)


def test_trl_dpo_runs_with_a_kfac_anchor(anchor_dir, tmp_path):
    needs("trl", "datasets")
    import datasets
    import trl

    tokenizer = tiny_tokenizer()
    model = tiny_llama(vocab_size=len(tokenizer))
    anchor_dir = tmp_path / "anchor"
    kfac_anchor(model).save_pretrained(anchor_dir)
    pairs = datasets.Dataset.from_dict(
        {"prompt": ["a b", "c d"] * 2, "chosen": [" e f", " g h"] * 2, "rejected": [" i j", " k l"] * 2}
    )
    args = trl.DPOConfig(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
    )
    cfp = CFPCallback(str(anchor_dir), lam=100.0)
    trainer = trl.DPOTrainer(
        model=model,
        ref_model=copy.deepcopy(model),
        args=args,
        train_dataset=pairs,
        processing_class=tokenizer,
        callbacks=[cfp],
    )
    trainer.train()
    logged = [row for row in trainer.state.log_history if PREDICTED_KL.key("math") in row]
    assert logged and logged[-1][PREDICTED_KL.key("math")] > 0
