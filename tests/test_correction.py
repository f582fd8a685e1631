"""The CFP correction against plain references: a per-parameter loop, closed forms, bit identity."""

import copy
import math

import pytest
import torch
from support.tiny import tiny_llama
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_cfp import CFPCallback, FisherAnchor
from hf_cfp.ops import apply_correction, lerp_weights
from hf_cfp.protection import CFPState


def random_anchor(model, name="math", seed=1, zero_fraction=0.3):
    """F ~ |N(0,1)| * 3 with a share of exact zeros, over every trainable parameter."""
    g = torch.Generator().manual_seed(seed)
    fisher = {}
    for n, p in model.named_parameters():
        f = torch.randn(p.shape, generator=g).abs() * 3
        f[torch.rand(p.shape, generator=g) < zero_fraction] = 0.0
        fisher[n] = f
    return FisherAnchor(fisher, name=name)


class ReferenceCFP(TrainerCallback):
    """The formula, one parameter and one expression at a time: theta0 + (theta - theta0) / (1 + lam F)."""

    def __init__(self, fisher, lam):
        self.fisher, self.lam = fisher, lam

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.theta0 = {n: p.detach().clone() for n, p in model.named_parameters()}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        lam = self.lam(state.global_step) if callable(self.lam) else self.lam
        with torch.no_grad():
            for n, p in model.named_parameters():
                t0 = self.theta0[n]
                p.copy_(t0 + (p - t0) / (1 + lam * self.fisher[n]))


def lm_dataset(n=16, length=12, vocab=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, vocab, (n, length), generator=g)]


def train(model, callbacks, tmp_path, steps=5, **overrides):
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=4, learning_rate=3e-2,
        use_cpu=True, report_to="none", logging_steps=1, save_strategy="no", seed=0, disable_tqdm=True,
        **overrides,
    )
    Trainer(model=model, args=args, train_dataset=lm_dataset(), callbacks=callbacks).train()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


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


def test_lam_zero_is_bit_identical_to_no_callback(tmp_path):
    base = tiny_llama()
    ours = train(copy.deepcopy(base), [CFPCallback(random_anchor(base), lam=0.0)], tmp_path / "a")
    plain = train(copy.deepcopy(base), [], tmp_path / "b")
    assert all(torch.equal(ours[n], plain[n]) for n in ours)


def test_zero_fisher_coordinates_keep_the_proposal_exactly():
    model = tiny_llama()
    anchor = random_anchor(model, zero_fraction=0.5)
    state = CFPState(model, anchor)
    with torch.no_grad():  # an optimizer proposal: move every coordinate
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    proposal = {n: p.detach().clone() for n, p in model.named_parameters()}
    state.correct(lam=5.0)
    for n, p in model.named_parameters():
        free = anchor.fisher[n] == 0
        assert torch.equal(p[free], proposal[n][free])
        assert (p[~free] != proposal[n][~free]).all()


def test_tied_weight_is_corrected_once():
    model = tiny_llama(tie=True)
    embed = model.model.embed_tokens.weight
    assert model.lm_head.weight is embed
    f = torch.rand(embed.shape) + 0.5
    # The anchor names the tied tensor twice; the correction must apply once, not twice.
    anchor = FisherAnchor({"model.embed_tokens.weight": f, "lm_head.weight": f}, name="tied")
    state = CFPState(model, anchor)
    theta0 = embed.detach().clone()
    with torch.no_grad():
        embed.add_(1.0)
    state.correct(lam=2.0)
    expected = theta0 + 1.0 / (1 + 2.0 * f)
    assert torch.allclose(embed, expected, atol=1e-6)


def test_bfloat16_parameters_are_corrected_in_float32():
    layer = torch.nn.Linear(64, 64).to(torch.bfloat16)
    fisher = {n: torch.rand(p.shape) * 4 for n, p in layer.named_parameters()}
    state = CFPState(layer, FisherAnchor(fisher, name="bf16"))
    theta0 = {n: p.detach().float() for n, p in layer.named_parameters()}
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.25)
    proposal = {n: p.detach().double() for n, p in layer.named_parameters()}
    state.correct(lam=3.0)
    for n, p in layer.named_parameters():
        exact = theta0[n].double() + (proposal[n] - theta0[n].double()) / (1 + 3.0 * fisher[n].double())
        assert p.dtype == torch.bfloat16
        assert torch.equal(p, exact.to(torch.bfloat16)) or (p.double() - exact).abs().max() <= 2 ** -8 * exact.abs().max()


def test_persistent_bias_converges_to_d_over_lam_f_while_step_shrinking_grows_linearly():
    """A constant step d each iteration (SGD on a linear loss): the CFP path converges to
    d / (lam F), closed form Delta_t = d/(lam F) * (1 - (1 + lam F)^-t); shrinking only the step,
    Delta_t = t d / (1 + lam F), grows without bound."""
    lam = 2.0
    fisher = torch.tensor([0.05, 0.2, 1.0, 3.0])
    d = torch.tensor([0.3, -0.1, 0.5, 0.2])
    layer = torch.nn.Linear(4, 1, bias=False)
    state = CFPState(layer, FisherAnchor({"weight": fisher.view(1, 4)}, name="bias"))
    theta0 = layer.weight.detach().clone()
    optimizer = torch.optim.SGD(layer.parameters(), lr=1.0)
    path = {}
    for t in range(1, 501):
        optimizer.zero_grad()
        (-(layer.weight * d).sum()).backward()  # gradient -d, so each SGD step adds d
        optimizer.step()
        state.correct(lam)
        path[t] = (layer.weight.detach() - theta0).view(4)
    fixed_point = d / (lam * fisher)
    rate = 1 / (1 + lam * fisher)
    assert torch.allclose(path[10], fixed_point * (1 - rate**10), rtol=1e-5, atol=1e-6)
    assert torch.allclose(path[500], fixed_point, rtol=1e-5)
    assert torch.allclose(path[250], path[500], rtol=1e-5)  # it has stopped moving

    step_only = {t: t * d * rate for t in (250, 500)}
    assert torch.allclose(step_only[500], 2 * step_only[250])  # linear growth
    assert (step_only[500].abs() > 10 * fixed_point.abs()).all()


def test_lerp_weights_closed_form():
    fisher = [torch.tensor([0.0, 0.5, 2.0, 1e6])]
    (w,) = lerp_weights(fisher, lam=4.0)
    expected = torch.tensor([0.0, 2.0 / 3.0, 8.0 / 9.0, 4e6 / (1 + 4e6)])
    assert torch.allclose(w, expected, rtol=1e-6)
    p, t0 = torch.tensor([1.0, 1.0, 1.0, 1.0]), torch.zeros(4)
    apply_correction([p], [t0], [w])
    # lerp computes 1 - w in float32: the error is absolute, about one float32 ulp of the step.
    assert torch.allclose(p, 1 / (1 + 4.0 * fisher[0]), rtol=1e-6, atol=2e-7)
    assert math.isclose(p[0].item(), 1.0)


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
