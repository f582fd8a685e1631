"""CFPState's correction (no Trainer) against plain references and closed forms: coordinates with
F = 0 keep the proposal exactly, a tied weight is corrected once, bf16 parameters are corrected in
float32, and a persistent bias converges to d / (lam F)."""

import torch
from support.anchors import random_anchor
from support.tiny import tiny_llama

from hf_cfp import FisherAnchor
from hf_cfp.protection import CFPState


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
        assert (
            torch.equal(p, exact.to(torch.bfloat16)) or (p.double() - exact).abs().max() <= 2**-8 * exact.abs().max()
        )


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
