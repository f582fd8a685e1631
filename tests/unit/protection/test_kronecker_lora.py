"""A K-FAC base anchor on a PEFT LoRA model: the correction of B is the exact proximal step under A_in (x) G in
base-weight space (a dense solve), the metrics are the K-FAC quadratic of merge_and_unload() minus the base
weights, and the rule without a K-FAC form is refused."""

import copy
import math

import pytest
import torch
from support.extras import needs
from support.tiny import tiny_llama

needs("peft")

from peft import LoraConfig, get_peft_model  # noqa: E402  (after the skip: peft is an extra)

from hf_cfp import estimate_fisher  # noqa: E402
from hf_cfp.errors import CFPArgumentError  # noqa: E402
from hf_cfp.names import ADAPTER_RESIDUAL, SENSITIVE_DRIFT  # noqa: E402
from hf_cfp.protection import CFPState  # noqa: E402

LAM = 20.0


def lora_setup(seed=0, rank=None):
    base = tiny_llama(vocab_size=40, hidden_size=16, layers=1, seed=seed)
    weights = {n: p.detach().double().clone() for n, p in base.named_parameters()}
    anchor = estimate_fisher(
        base,
        None,
        [[1, 2, 3], [4, 5]],
        num_sequences=6,
        max_new_tokens=4,
        seed=seed,
        structure="kfac",
        kfac_rank=rank,
        show_progress=False,
        name="math",
    )
    model = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights="gaussian"))
    return weights, anchor, model


def lora_layers(model):
    return {
        n.replace("base_model.model.", "") + ".weight": m
        for n, m in model.named_modules()
        if hasattr(m, "lora_A") and "default" in getattr(m, "lora_A", {})
    }


@pytest.mark.parametrize("rank", [None, 3])  # 3: the top 3 eigenpairs of each factor and the mean tail
def test_b_is_the_dense_proximal_minimizer_and_the_metrics_are_the_merged_quadratic(rank):
    weights, anchor, model = lora_setup(rank=rank)
    assert all(basis.tailed == (rank is not None) for basis in anchor.kfac.values())
    state = CFPState(model, anchor)
    layers = lora_layers(model)
    assert sorted(layers) == sorted(w.name for w, _, _ in state.adapters.factored)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # the optimizer's proposal: both factors move
        for layer in layers.values():
            layer.lora_B["default"].weight.add_(0.3 * torch.randn(layer.lora_B["default"].weight.shape, generator=g))
            layer.lora_A["default"].weight.add_(0.1 * torch.randn(layer.lora_A["default"].weight.shape, generator=g))
    merged = dict(copy.deepcopy(model).merge_and_unload().named_parameters())
    sensitive = 0.0
    for name in layers:
        delta = (merged[name].detach().double() - weights[name]).reshape(-1)
        a, gg = anchor.kfac_factors(name)
        sensitive += float(delta @ torch.kron(gg.double(), a.double()) @ delta)
    assert state.drift_metrics()[SENSITIVE_DRIFT.key("math")] == pytest.approx(math.sqrt(sensitive), rel=1e-4)

    expected = {}
    for name, layer in layers.items():  # argmin_B ||X - D||^2 + lam vec(X)^T (G (x) A_in) vec(X), X = s B A
        s, a = float(layer.scaling["default"]), layer.lora_A["default"].weight.detach().double()
        d = (s * layer.lora_B["default"].weight.detach().double() @ a).reshape(-1)
        a_in, gg = (f.double() for f in anchor.kfac_factors(name))
        kernel = torch.kron(gg, a_in)
        m = s * torch.kron(torch.eye(gg.shape[0], dtype=torch.float64), a.T.contiguous())
        lhs = m.T @ (torch.eye(len(d), dtype=torch.float64) + LAM * kernel) @ m
        expected[name] = torch.linalg.solve(lhs, m.T @ d).reshape(gg.shape[0], -1)
    state.correct(LAM, measure_residual=True)
    for name, layer in layers.items():
        assert torch.allclose(layer.lora_B["default"].weight.double(), expected[name], rtol=1e-4, atol=1e-5), name
    residual = state.drift_metrics()[ADAPTER_RESIDUAL.key("math")]
    assert 0 < residual < 1  # rank 2 cannot reach the full-parameter target, but gets part of the way


def test_factor_space_has_no_kfac_form():
    _, anchor, model = lora_setup(seed=2)
    with pytest.raises(CFPArgumentError, match="factor_space.*Kronecker-factored"):
        CFPState(model, anchor, lora_rule="factor_space")


def test_several_protecting_anchors_on_an_adapted_weight_are_refused_with_what_to_do():
    weights, anchor, model = lora_setup(rank=3)
    base = tiny_llama(vocab_size=40, hidden_size=16, layers=1, seed=0)  # the same base weights, without adapters
    other = estimate_fisher(
        base, None, [[6, 7]], num_sequences=4, max_new_tokens=3, show_progress=False, name="safety"
    )
    with pytest.raises(CFPArgumentError, match="LoRA-adapted weight.*monitor="):
        CFPState(model, [anchor, other])
    CFPState(model, anchor, monitors=[other])  # measured, not corrected: accepted
