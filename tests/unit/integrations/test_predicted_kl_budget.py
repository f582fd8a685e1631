"""CFPCallback(predicted_kl_budget=...) and scale_lam_with_lr in a real Trainer run on the tiny model: the budget's
rules (never exceeded by more than 5% at a logged step, not over-protecting, bit-identical to no correction while the
path stays inside), refused arguments, lr-scaled lam against a hand-written loop, and the train-begin line."""

import logging
import math

import pytest
import torch
from support.extras import needs
from support.tiny import anchor_for, tiny_llama
from support.training import adamw_loop, full_batch_rows, full_batch_trainer_args, train
from transformers import Trainer, TrainerCallback

from hf_cfp import CFPCallback
from hf_cfp.errors import CFPArgumentError

STEPS = 6


def trained(tmp_path, **callback_kwargs):
    """Train the tiny model STEPS steps with CFPCallback(anchor of model seed 0, **callback_kwargs); returns the
    final parameters and every logged cfp/math value per step."""
    model = tiny_llama()
    callback = CFPCallback(anchor_for(tiny_llama()), **callback_kwargs)
    history = []

    class Record(TrainerCallback):  # listed after CFP: sees its metrics
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                history.append(dict(logs))

    params = train(model, [callback, Record()], tmp_path, steps=STEPS)
    return params, history


def test_a_budget_never_reached_is_bit_identical_to_no_correction(tmp_path):
    plain = train(tiny_llama(), [], tmp_path / "plain", steps=STEPS)
    protected, history = trained(tmp_path / "budget", predicted_kl_budget=1e9)
    assert all(torch.equal(plain[n], protected[n]) for n in plain)
    assert [h["cfp/math/lam"] for h in history] == [0.0] * STEPS


def test_a_reached_budget_holds_at_every_logged_step_without_over_protecting(tmp_path):
    _, free = trained(tmp_path / "free", lam=0.0)
    unprotected = [h["cfp/math/predicted_kl"] for h in free]
    budget = (unprotected[1] + unprotected[2]) / 2  # the unprotected path leaves it at step 3
    assert unprotected[1] < budget < unprotected[2]
    _, history = trained(tmp_path / "budget", predicted_kl_budget=budget)
    predicted = [h["cfp/math/predicted_kl"] for h in history]
    assert max(predicted) <= 1.05 * budget, predicted
    assert predicted[-1] >= 0.8 * budget, predicted
    lams = [h["cfp/math/lam"] for h in history]
    # lam_t = 0 while the unprotected path is still inside the budget, > 0 once it would leave it
    assert lams[:2] == [0.0, 0.0] and predicted[:2] == unprotected[:2]
    assert all(lam > 0 for lam in lams[2:]), lams


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(lam=1.0, predicted_kl_budget=0.1), "not both"),
        (dict(predicted_kl_budget=0.0), "predicted_kl_budget must be finite and > 0"),
        (dict(predicted_kl_budget=float("nan")), "predicted_kl_budget must be finite"),
        (dict(predicted_kl_budget=[0.1, 0.2]), "sequence of 1 numbers"),
        (dict(predicted_kl_budget=0.1, scale_lam_with_lr=True), "scale_lam_with_lr"),
        (dict(lam=[1.0, 2.0]), "sequence of 1 numbers"),
    ],
)
def test_bad_budget_arguments_are_refused(kwargs, match):
    with pytest.raises(CFPArgumentError, match=match):
        CFPCallback(anchor_for(tiny_llama()), **kwargs)


def test_a_budget_on_lora_adapted_weights_is_refused_at_train_begin(tmp_path):
    needs("peft")
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    callback = CFPCallback(anchor_for(tiny_llama()), predicted_kl_budget=0.1)
    with pytest.raises(CFPArgumentError, match="LoRA-adapted"):
        train(peft_model, [callback], tmp_path, steps=1)


def test_lr_scaled_lam_is_the_proximal_step_at_each_steps_learning_rate(tmp_path):
    """Linear decay from lr over T steps: step t (0-based) runs at eta_t = lr (T - t) / T, and CFP pulls with
    lam eta_t. The Trainer's path equals AdamW by hand with that rule, and the logged lam is lam eta_t."""
    lam, lr, rows = 3e3, 1e-2, full_batch_rows()
    model, reference = tiny_llama(), tiny_llama()
    anchor = anchor_for(tiny_llama())
    callback = CFPCallback(anchor, lam=lam, scale_lam_with_lr=True)
    args = full_batch_trainer_args(tmp_path, rows, STEPS, lr=lr, lr_scheduler_type="linear")
    trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[callback])
    trainer.train()

    theta0 = {n: p.detach().double().clone() for n, p in reference.named_parameters()}
    etas = iter([lr * (STEPS - t) / STEPS for t in range(STEPS)])
    optimizer_lr = []

    def cfp_at_eta():
        eta = next(etas)
        optimizer_lr.append(eta)
        with torch.no_grad():
            for n, p in reference.named_parameters():
                p.copy_(theta0[n] + (p.double() - theta0[n]) / (1 + eta * lam * anchor.fisher[n].double()))

    adamw_loop(reference, rows, STEPS, lr=lr, after_step=cfp_at_eta, lr_at=lambda t: lr * (STEPS - t) / STEPS)
    for (n, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q.float(), rtol=1e-5, atol=1e-6, msg=n)
    logged_lams = [h["cfp/math/lam"] for h in trainer.state.log_history if "cfp/math/lam" in h]
    assert logged_lams == pytest.approx([lam * eta for eta in optimizer_lr], rel=1e-6)


def test_train_begin_line_says_what_lam_does(tmp_path, caplog):
    anchor = anchor_for(tiny_llama())
    lam = 2.5  # F ~ U(0, 1): lam F > 1 where F > 0.4, about 60% of the coordinates
    with caplog.at_level(logging.INFO, logger="hf_cfp"):
        train(tiny_llama(), [CFPCallback(anchor, lam=lam)], tmp_path, steps=1)
    flat = torch.cat([f.reshape(-1) for f in anchor.fisher.values()])
    share = float((lam * flat > 1).double().mean())
    p99, p999 = (float(torch.kthvalue(lam * flat, math.ceil(q * flat.numel())).values) for q in (0.99, 0.999))
    (line,) = [r.getMessage() for r in caplog.records if "back by more than half" in r.getMessage()]
    assert f"pulls {share:.2%} of {flat.numel():,} protected coordinates" in line
    # train()'s lr 3e-2
    assert f"settles at |theta - theta0| = {3e-2 / p99:.3g} at the 99th percentile of lam F, {3e-2 / p999:.3g}" in line
