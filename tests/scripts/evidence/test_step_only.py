"""StepOnlyCallback: theta_{t+1} = theta_t + d_t / (1 + lam F). Through a Trainer against the rule applied by hand
after each step of the same AdamW (support.training.adamw_loop), with the drift logged by a measuring
CFPCallback(lam=0) against the float64 reference; lam = 0 bit-identical to no callback; under a constant proposal
the closed forms t d / (1 + lam F) (step-only, linear) and d a (1 - a^t) / (1 - a), a = 1 / (1 + lam F) (CFP,
bounded by d / (lam F))."""

import copy

import pytest
import torch
from evidence import StepOnlyCallback
from support.anchors import random_anchor
from support.references import assert_metrics_match, drift_reference
from support.tiny import tiny_llama
from support.training import adamw_loop, full_batch_rows, full_batch_trainer_args, last_cfp_logs
from transformers import Trainer, TrainerState

from hf_cfp import CFPCallback, CFPError, FisherAnchor
from hf_cfp.errors import AnchorMismatchError, CFPArgumentError


def run_trainer(model, tmp_path, callbacks, steps):
    rows = full_batch_rows()
    trainer = Trainer(
        model=model, args=full_batch_trainer_args(tmp_path, rows, steps), train_dataset=rows, callbacks=callbacks
    )
    trainer.train()
    return trainer


@pytest.mark.parametrize("measurer_first", [False, True], ids=["step-only-listed-first", "measurer-listed-first"])
def test_trainer_path_and_logged_drift_match_the_rule_applied_by_hand(tmp_path, measurer_first):
    lam, steps = 2.0, 4
    model = tiny_llama()
    anchor, monitor = random_anchor(model, "math", seed=1), random_anchor(model, "code", seed=2)
    reference = copy.deepcopy(model)
    theta0 = {n: p.detach().double().clone() for n, p in model.named_parameters()}

    callbacks = [StepOnlyCallback(anchor, lam), CFPCallback(anchor, lam=0.0, monitor=[monitor])]
    trainer = run_trainer(model, tmp_path, callbacks[::-1] if measurer_first else callbacks, steps)

    previous = copy.deepcopy(theta0)

    def step_only():
        with torch.no_grad():
            for n, p in reference.named_parameters():
                p.copy_(previous[n] + (p.double() - previous[n]) / (1 + lam * anchor.fisher[n].double()))
                previous[n] = p.detach().double().clone()

    adamw_loop(reference, full_batch_rows(), steps, after_step=step_only)
    for (n, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), n
    deltas = {n: p.detach().double() - theta0[n] for n, p in reference.named_parameters()}
    expected = {**drift_reference(deltas, anchor.fisher, "math"), **drift_reference(deltas, monitor.fisher, "code")}
    assert_metrics_match(last_cfp_logs(trainer), expected, rel=1e-4)


def test_lam_zero_is_bit_identical_to_no_callback(tmp_path):
    plain, step_only = tiny_llama(), tiny_llama()
    run_trainer(plain, tmp_path / "plain", [], steps=3)
    run_trainer(step_only, tmp_path / "step-only", [StepOnlyCallback(random_anchor(step_only), 0.0)], steps=3)
    for (n, p), q in zip(plain.named_parameters(), step_only.parameters(), strict=True):
        assert torch.equal(p, q), n


def test_constant_proposal_grows_linearly_under_step_only_and_stays_bounded_under_cfp():
    """The optimizer's proposal is theta_t + d every step (no Trainer: the callbacks are driven by hand)."""
    lam, steps = 2.0, 60
    models = {kind: torch.nn.Linear(3, 2) for kind in ("step-only", "cfp")}
    for model in models.values():  # theta0 = 0: float32 holds each displacement to its own relative precision
        torch.nn.init.zeros_(model.weight)
        torch.nn.init.zeros_(model.bias)
    g = torch.Generator().manual_seed(0)
    fisher = {n: 0.1 + torch.rand(p.shape, generator=g) for n, p in models["cfp"].named_parameters()}
    d = {n: torch.randn(p.shape, generator=g) * 1e-2 for n, p in models["cfp"].named_parameters()}
    anchor = FisherAnchor(fisher)
    callbacks = {"step-only": StepOnlyCallback(anchor, lam), "cfp": CFPCallback(anchor, lam)}
    theta0 = {n: p.detach().double().clone() for n, p in models["cfp"].named_parameters()}
    state = TrainerState()
    for kind, callback in callbacks.items():
        callback.on_train_begin(None, state, None, model=models[kind])
    for t in range(1, steps + 1):
        state.global_step = t
        for kind, callback in callbacks.items():
            with torch.no_grad():
                for n, p in models[kind].named_parameters():
                    p.add_(d[n])
            callback.on_step_end(None, state, None, model=models[kind])
        for n in fisher:
            f, dn = fisher[n].double(), d[n].double()
            a = 1 / (1 + lam * f)
            step_only = models["step-only"].get_parameter(n).detach().double() - theta0[n]
            cfp = models["cfp"].get_parameter(n).detach().double() - theta0[n]
            assert torch.allclose(step_only, t * dn * a, rtol=1e-5, atol=0), (n, t)
            assert torch.allclose(cfp, dn * a * (1 - a**t) / (1 - a), rtol=1e-5, atol=0), (n, t)
            assert (cfp.abs() <= (dn / (lam * f)).abs() * (1 + 1e-5)).all()
    bound = {n: d[n].double() / (lam * fisher[n].double()) for n in fisher}
    for n in fisher:  # after 60 steps CFP sits at its fixed point, while step-only is 60 steps out
        assert torch.allclose(models["cfp"].get_parameter(n).detach().double() - theta0[n], bound[n], rtol=1e-3)


def test_bad_arguments_and_anchors_of_other_models_are_refused():
    model = torch.nn.Linear(3, 2)
    fisher = {"weight": torch.ones(2, 3), "bias": torch.ones(2)}
    for lam in (-1.0, float("nan"), "1"):
        with pytest.raises(CFPArgumentError, match="lam"):
            StepOnlyCallback(FisherAnchor(fisher), lam)
    with pytest.raises(CFPArgumentError, match="FisherAnchor"):
        StepOnlyCallback(fisher, 1.0)
    with pytest.raises(CFPError, match="before on_train_begin"):
        StepOnlyCallback(FisherAnchor(fisher), 1.0).on_step_end(None, TrainerState(), None, model=model)
    missing = StepOnlyCallback(FisherAnchor({**fisher, "extra.weight": torch.ones(1)}), 1.0)
    with pytest.raises(AnchorMismatchError, match="'extra.weight'"):
        missing.on_train_begin(None, TrainerState(), None, model=model)
    reshaped = StepOnlyCallback(FisherAnchor({**fisher, "bias": torch.ones(3)}), 1.0)
    with pytest.raises(AnchorMismatchError, match="'bias' has shape"):
        reshaped.on_train_begin(None, TrainerState(), None, model=model)
