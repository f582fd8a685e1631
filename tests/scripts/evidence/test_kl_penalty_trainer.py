"""KLPenaltySFTTrainer: loss = CE + beta * KLbar against a float64 reference written position by position and
token by token (value and gradient), beta = 0 bit-identical to a plain Trainer, `kl_penalty` in the logs, and
bad arguments refused."""

import copy
import math

import pytest
import torch
from evidence import KLPenaltySFTTrainer
from support.tiny import tiny_llama
from support.training import full_batch_rows, full_batch_trainer_args
from transformers import Trainer

from hf_cfp.errors import CFPArgumentError


def masked_rows():
    """Full-batch rows whose labels skip a prompt of 3 tokens and one more position per row."""
    rows = full_batch_rows()
    for i, row in enumerate(rows):
        row["labels"][:3] = -100
        row["labels"][5 + i] = -100
    return rows


def reference_loss(model, ref_model, batch, beta, divisor=None):
    """CE + beta * KLbar in float64: for every position t whose next label is scored, -log p(label) and
    sum_v p_v (log p_v - log q_v), log p_v = z_v - log sum_u exp(z_u); both summed and divided by the
    number of scored positions (or by `divisor`). Differentiable in `model`, not in `ref_model`."""
    logits = model.double()(input_ids=batch["input_ids"]).logits
    with torch.no_grad():
        ref_logits = ref_model.double()(input_ids=batch["input_ids"]).logits
    labels = batch["labels"]
    ce, kl, count = 0.0, 0.0, 0
    for b in range(labels.shape[0]):
        for t in range(labels.shape[1] - 1):
            label = int(labels[b, t + 1])
            if label == -100:
                continue
            z, y = logits[b, t], ref_logits[b, t]
            vocab = range(z.shape[0])
            log_z = torch.log(sum(torch.exp(z[v]) for v in vocab))
            log_y = torch.log(sum(torch.exp(y[v]) for v in vocab))
            ce = ce - (z[label] - log_z)
            kl = kl + sum(torch.exp(z[v] - log_z) * ((z[v] - log_z) - (y[v] - log_y)) for v in vocab)
            count += 1
    return (ce + beta * kl) / (divisor or count), count


@pytest.mark.parametrize("pass_count", [False, True], ids=["batch-count", "num_items_in_batch"])
def test_compute_loss_and_its_gradient_match_the_float64_reference(tmp_path, pass_count):
    beta, rows = 0.7, masked_rows()
    model, ref_model = tiny_llama(seed=0), tiny_llama(seed=1)
    batch = {key: torch.stack([row[key] for row in rows]) for key in rows[0]}
    model64, ref64 = copy.deepcopy(model), copy.deepcopy(ref_model)
    count = int((batch["labels"][:, 1:] != -100).sum())
    divisor = 2 * count if pass_count else None  # as if this were half of an accumulated batch
    expected, scored = reference_loss(model64, ref64, batch, beta, divisor)
    assert scored == count

    args = full_batch_trainer_args(tmp_path, rows, steps=1)
    trainer = KLPenaltySFTTrainer(model=model, args=args, ref_model=ref_model, kl_beta=beta)
    num_items = torch.tensor(divisor) if pass_count else None
    loss = trainer.compute_loss(model, dict(batch), num_items_in_batch=num_items)
    assert float(loss.detach()) == pytest.approx(float(expected.detach()), rel=1e-5)

    loss.backward()
    expected.backward()
    for (name, p), p64 in zip(model.named_parameters(), model64.parameters(), strict=True):
        scale = float(p64.grad.abs().max())
        assert torch.allclose(p.grad.double(), p64.grad, rtol=1e-4, atol=1e-5 * scale), name
    assert all(p.grad is None for p in ref_model.parameters())  # no gradient through the reference
    assert not trainer.ref_model.training


def test_beta_zero_is_bit_identical_to_the_plain_trainer(tmp_path):
    rows = masked_rows()
    plain, penalized = tiny_llama(), tiny_llama()
    plain_trainer = Trainer(model=plain, args=full_batch_trainer_args(tmp_path / "a", rows, 3), train_dataset=rows)
    plain_trainer.train()
    kl_trainer = KLPenaltySFTTrainer(
        model=penalized,
        args=full_batch_trainer_args(tmp_path / "b", rows, 3),
        train_dataset=rows,
        ref_model=tiny_llama(seed=1),
        kl_beta=0.0,
    )
    kl_trainer.train()
    for (n, p), q in zip(plain.named_parameters(), penalized.parameters(), strict=True):
        assert torch.equal(p, q), n
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (plain_trainer, kl_trainer)]
    assert losses[0] == losses[1] and len(losses[0]) == 3


def test_kl_penalty_is_logged_zero_at_the_start_and_positive_once_the_model_moved(tmp_path):
    rows = masked_rows()
    model = tiny_llama()
    trainer = KLPenaltySFTTrainer(
        model=model,
        args=full_batch_trainer_args(tmp_path, rows, 3),
        train_dataset=rows,
        ref_model=copy.deepcopy(model),
        kl_beta=1.0,
    )
    trainer.train()
    logged = [h["kl_penalty"] for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 3
    assert logged[0] == 0.0  # the first batch is scored by identical weights
    assert all(value > 0 and math.isfinite(value) for value in logged[1:])


def test_bad_arguments_are_refused(tmp_path):
    model = tiny_llama()
    args = full_batch_trainer_args(tmp_path, masked_rows(), steps=1)
    for beta in (-0.1, float("nan"), float("inf"), True, "1"):
        with pytest.raises(CFPArgumentError, match="kl_beta"):
            KLPenaltySFTTrainer(model=model, args=args, ref_model=tiny_llama(seed=1), kl_beta=beta)
    with pytest.raises(CFPArgumentError, match="ref_model"):
        KLPenaltySFTTrainer(model=model, args=args, kl_beta=0.1)
    with pytest.raises(CFPArgumentError, match="ref_model is the model being trained"):
        KLPenaltySFTTrainer(model=model, args=args, ref_model=model, kl_beta=0.1)
