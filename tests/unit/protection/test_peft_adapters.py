"""A base-model anchor on a PEFT LoRA model: names mapped through PEFT, drift measured in base-weight space.

The reference is written here in float64: `merge_and_unload()` of a deep copy, minus the base weights, with
the anchor's F; the free threshold is the k-th smallest F (k = ceil(0.99 n)) over the weights that can move.
"""

import copy
import math

import pytest
import torch
from support.extras import needs

needs("peft")

from peft import IA3Config, LoraConfig, PromptTuningConfig, get_peft_model  # noqa: E402
from support.references import assert_metrics_match, drift_reference, train_a_little  # noqa: E402
from support.tiny import anchor_for, tiny_llama, tiny_tokenizer  # noqa: E402
from support.training import last_cfp_logs, short_run  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, TrainerControl, TrainerState  # noqa: E402

from hf_cfp import CFPCallback, CFPError, FisherAnchor, estimate_fisher  # noqa: E402
from hf_cfp.anchor.fingerprint import model_fingerprint  # noqa: E402
from hf_cfp.errors import AnchorMismatchError, CFPArgumentError  # noqa: E402
from hf_cfp.protection import CFPState, SavedTheta0, save_theta0  # noqa: E402

ADAPTED = [f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(2) for p in "qv"]


def lora_model(seed=0, **config):
    """(base weights float64 by name, anchor over every base parameter, PeftModel with LoRA on q_proj and v_proj;
    r=4 unless `config` says otherwise)."""
    base = tiny_llama(seed=seed)
    weights = {n: p.detach().double().clone() for n, p in base.named_parameters()}
    anchor = anchor_for(base, seed=seed + 1)
    anchor.metadata["base_fingerprint"] = model_fingerprint(base)
    peft_model = get_peft_model(base, LoraConfig(**{"r": 4, "target_modules": ["q_proj", "v_proj"], **config}))
    return weights, anchor, peft_model


def merged_reference(peft_model, origin, anchor, moving, free_fraction=0.99):
    """float64 metrics of merge_and_unload() against `origin` (name -> weights) over the names in `moving`."""
    merged = dict(copy.deepcopy(peft_model).merge_and_unload().named_parameters())
    deltas = {n: merged[n].detach().double() - origin[n] for n in moving}
    return drift_reference(deltas, anchor.fisher, anchor.name, free_fraction)


def test_base_anchor_binds_through_peft_names():
    _, anchor, peft_model = lora_model(modules_to_save=["lm_head"])
    state = CFPState(peft_model, anchor, free_fraction=0.99)
    assert [w.name for w in state.adapted] == ADAPTED
    assert state.names == ["lm_head.weight"]  # the one trained base parameter: its modules_to_save copy
    assert state.tensors[0].param is peft_model.base_model.model.lm_head.modules_to_save["default"].weight
    assert [w.name for w, _ in state.adapters.weights] == ADAPTED  # the protecting anchor corrects them
    assert all(v == 0 for v in state.drift_metrics().values())  # nothing moved since bind


@pytest.mark.parametrize("config", [{}, {"use_rslora": True, "lora_alpha": 16}], ids=["lora", "rslora"])
def test_drift_equals_the_merged_model_against_the_base_weights(config):
    weights, anchor, peft_model = lora_model(**config)
    if config:
        q = peft_model.base_model.model.model.layers[0].self_attn.q_proj
        assert q.scaling["default"] == pytest.approx(16 / math.sqrt(4))  # rsLoRA: alpha / sqrt(r)
    state = CFPState(peft_model, anchor)
    train_a_little(peft_model)
    assert_metrics_match(state.drift_metrics(), merged_reference(peft_model, weights, anchor, ADAPTED))


def test_modules_to_save_copy_is_trained_and_measured_with_the_base_fisher():
    weights, anchor, peft_model = lora_model(modules_to_save=["lm_head"])
    state = CFPState(peft_model, anchor)
    train_a_little(peft_model)
    moving = [*ADAPTED, "lm_head.weight"]
    assert_metrics_match(state.drift_metrics(), merged_reference(peft_model, weights, anchor, moving))
    lm_only = merged_reference(peft_model, weights, anchor, ["lm_head.weight"])["cfp/total_drift"]
    assert lm_only > 0.1  # the copy did move, and counts


def test_trained_bias_is_measured():
    base = tiny_llama(attention_bias=True)
    weights = {n: p.detach().double().clone() for n, p in base.named_parameters()}
    anchor = anchor_for(base)
    peft_model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], bias="all"))
    state = CFPState(peft_model, anchor)
    biases = [n for n in weights if n.endswith("bias")]
    assert sorted(state.names) == sorted(biases)
    train_a_little(peft_model)
    assert_metrics_match(state.drift_metrics(), merged_reference(peft_model, weights, anchor, ADAPTED + biases))


def test_nonzero_lora_init_is_subtracted_pissa():
    weights, anchor, peft_model = lora_model(init_lora_weights="pissa")
    q = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    assert q.lora_B["default"].weight.abs().max() > 0  # B0 A0 != 0 at bind
    state = CFPState(peft_model, anchor)
    assert max(state.drift_metrics().values()) < 1e-6  # PiSSA keeps the merged model = base at init
    train_a_little(peft_model)
    assert_metrics_match(state.drift_metrics(), merged_reference(peft_model, weights, anchor, ADAPTED))


def test_nonzero_lora_factors_at_bind_are_the_origin():
    _, anchor, peft_model = lora_model()
    train_a_little(peft_model, seed=1)  # B0 A0 != 0 when CFP binds
    merged_at_bind = {
        n: p.detach().double() for n, p in copy.deepcopy(peft_model).merge_and_unload().named_parameters()
    }
    state = CFPState(peft_model, anchor)
    train_a_little(peft_model, seed=2)
    assert_metrics_match(state.drift_metrics(), merged_reference(peft_model, merged_at_bind, anchor, ADAPTED))


def test_dora_is_refused_clearly():
    _, anchor, peft_model = lora_model(use_dora=True)
    with pytest.raises(CFPError, match=r"q_proj.weight.*DoRA"):
        CFPState(peft_model, anchor)


@pytest.mark.parametrize(
    "config, kind",
    [
        (IA3Config(target_modules=["k_proj", "v_proj"], feedforward_modules=[]), "IA3"),
        (PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4), "PROMPT_TUNING"),
    ],
)
def test_other_adapter_types_are_refused_by_name(config, kind):
    base = tiny_llama()
    anchor = anchor_for(base)
    with pytest.raises(CFPError, match=f"LoRA adapters only.*{kind}"):
        CFPState(get_peft_model(base, config), anchor)


def merged_weights(peft_model, names):
    """name -> float64 weights of merge_and_unload() of a deep copy."""
    merged = dict(copy.deepcopy(peft_model).merge_and_unload().named_parameters())
    return {n: merged[n].detach().double() for n in names}


def row_constant_anchor(anchor, seed=7):
    """`anchor` with F_ij = u_i (constant along each row) on the adapted weights."""
    g = torch.Generator().manual_seed(seed)
    fisher = dict(anchor.fisher)
    for name in ADAPTED:
        rows = fisher[name].shape[0]
        fisher[name] = (torch.rand(rows, generator=g) * 4)[:, None].expand_as(fisher[name]).contiguous()
    return FisherAnchor(fisher, name=anchor.name, metadata=dict(anchor.metadata))


@pytest.mark.parametrize("rule", ["proximal_b", "least_squares_b"])
@pytest.mark.parametrize("config", [{}, {"use_rslora": True, "lora_alpha": 16}], ids=["lora", "rslora"])
def test_correction_equals_full_parameter_cfp_when_f_is_constant_along_rows(config, rule):
    weights, anchor, peft_model = lora_model(modules_to_save=["lm_head"], **config)
    anchor = row_constant_anchor(anchor)
    state = CFPState(peft_model, anchor, lora_rule=rule)
    lam = 3.0
    for step in range(3):
        train_a_little(peft_model, seed=step)
        proposal = merged_weights(peft_model, [*ADAPTED, "lm_head.weight"])
        state.correct(lam, measure_residual=True)
        corrected = merged_weights(peft_model, [*ADAPTED, "lm_head.weight"])
        for name, theta in proposal.items():  # full-parameter CFP on the merged model, float64
            target = weights[name] + (theta - weights[name]) / (1 + lam * anchor.fisher[name].double())
            error = float((corrected[name] - target).norm() / (target - weights[name]).norm())
            assert error < 1e-5, (step, name, error)
        assert state.adapters.residual < 1e-5


@pytest.mark.parametrize("rule", ["proximal_b", "least_squares_b", "factor_space"])
def test_adapters_of_modules_with_zero_fisher_keep_the_optimizers_proposal_bitwise(rule):
    _, anchor, peft_model = lora_model()
    silent = "model.layers.0.self_attn.q_proj.weight"
    anchor.fisher[silent] = torch.zeros_like(anchor.fisher[silent])
    q = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    v = peft_model.base_model.model.model.layers[0].self_attn.v_proj
    state = CFPState(peft_model, anchor, lora_rule=rule)
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 32, (2, 10), generator=torch.Generator().manual_seed(0))
    for _ in range(4):
        peft_model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        proposal = [t.detach().clone() for t in (q.lora_A["default"].weight, q.lora_B["default"].weight)]
        v_proposal = v.lora_B["default"].weight.detach().clone()
        state.correct(5.0)
        assert torch.equal(q.lora_A["default"].weight, proposal[0])
        assert torch.equal(q.lora_B["default"].weight, proposal[1])
        assert not torch.equal(v.lora_B["default"].weight, v_proposal)  # F > 0 there: corrected


def test_adapter_residual_is_the_missed_share_of_the_merged_target():
    weights, anchor, peft_model = lora_model()
    state = CFPState(peft_model, anchor)  # F uniform random: not representable exactly
    train_a_little(peft_model)
    proposal = merged_weights(peft_model, ADAPTED)
    state.correct(2.0, measure_residual=True)
    corrected = merged_weights(peft_model, ADAPTED)
    missed, target_sq = 0.0, 0.0
    for name in ADAPTED:
        target = (proposal[name] - weights[name]) / (1 + 2.0 * anchor.fisher[name].double())
        missed += float((corrected[name] - weights[name] - target).square().sum())
        target_sq += float(target.square().sum())
    expected = math.sqrt(missed / target_sq)
    assert 0.01 < expected < 1
    assert state.adapters.residual == pytest.approx(expected, rel=1e-4)
    assert state.drift_metrics()["cfp/math/adapter_residual"] == state.adapters.residual


def test_more_than_one_active_adapter_is_refused_when_correcting():
    _, anchor, peft_model = lora_model()
    peft_model.add_adapter("other", LoraConfig(r=2, target_modules=["q_proj"]))
    peft_model.base_model.set_adapter(["default", "other"])
    state = CFPState(peft_model, anchor)
    state.correct(0.0)  # measuring both is fine
    with pytest.raises(CFPError, match="one LoRA adapter per weight.*'default', 'other'"):
        state.correct(1.0)


def test_an_unknown_lora_rule_is_refused():
    _, anchor, _ = lora_model()
    with pytest.raises(CFPArgumentError, match="lora_rule must be one of"):
        CFPCallback(anchor, lora_rule="svd")


def test_lam_is_allowed_when_only_non_adapter_parameters_are_protected():
    _, anchor, peft_model = lora_model(modules_to_save=["lm_head"])
    lm_anchor = FisherAnchor({"lm_head.weight": anchor.fisher["lm_head.weight"]}, name="lm")
    callback = CFPCallback(lm_anchor, lam=1.0, monitor=[anchor])  # monitors may cover adapted weights
    callback.on_train_begin(None, TrainerState(), TrainerControl(), model=peft_model)
    copy_weight = peft_model.base_model.model.lm_head.modules_to_save["default"].weight
    before = copy_weight.detach().clone()
    train_a_little(peft_model)
    moved = copy_weight.detach() - before
    callback.protection.correct(1.0)
    expected = before + moved / (1 + lm_anchor.fisher["lm_head.weight"])
    torch.testing.assert_close(copy_weight.detach(), expected)


def test_fingerprint_sees_through_the_wrapper():
    _, anchor, peft_model = lora_model(modules_to_save=["lm_head"])
    CFPCallback(anchor, lam=0.0).on_train_begin(None, TrainerState(), TrainerControl(), model=peft_model)
    _, _, other = lora_model(seed=5)  # same architecture, other base weights
    with pytest.raises(AnchorMismatchError, match="different weights"):
        CFPCallback(anchor, lam=0.0).on_train_begin(None, TrainerState(), TrainerControl(), model=other)


def test_a_missing_base_name_is_still_refused():
    _, anchor, peft_model = lora_model()
    wrong = FisherAnchor({"model.layers.9.self_attn.q_proj.weight": torch.ones(16, 16)}, name="x")
    with pytest.raises(AnchorMismatchError, match="layers.9"):
        CFPState(peft_model, wrong)


def test_trainer_run_logs_the_merged_models_drift(tmp_path):
    weights, anchor, peft_model = lora_model(modules_to_save=["lm_head"])
    trainer = short_run(peft_model, tmp_path, [CFPCallback(anchor, lam=0.0)])
    assert trainer.state.log_history[-2]["step"] == 4
    reference = merged_reference(peft_model, weights, anchor, [*ADAPTED, "lm_head.weight"])
    assert_metrics_match(last_cfp_logs(trainer), reference)


def test_lam_zero_is_bit_identical_to_no_callback(tmp_path):
    _, anchor, with_cfp = lora_model(modules_to_save=["lm_head"])
    _, _, without = lora_model(modules_to_save=["lm_head"])
    short_run(with_cfp, tmp_path / "a", [CFPCallback(anchor, lam=0.0)])
    short_run(without, tmp_path / "b")
    for (name, p), (_, q) in zip(with_cfp.named_parameters(), without.named_parameters(), strict=True):
        assert torch.equal(p, q), name


def test_large_lam_cuts_base_space_sensitive_drift_at_least_5x_and_logs_the_residual(tmp_path):
    _, anchor, free_run = lora_model(modules_to_save=["lm_head"])
    _, _, protected_run = lora_model(modules_to_save=["lm_head"])
    free = last_cfp_logs(short_run(free_run, tmp_path / "free", [CFPCallback(anchor, lam=0.0)]))
    protected = last_cfp_logs(short_run(protected_run, tmp_path / "cfp", [CFPCallback(anchor, lam=1e3)]))
    assert protected["cfp/math/sensitive_drift"] * 5 <= free["cfp/math/sensitive_drift"]
    assert "cfp/math/adapter_residual" not in free  # lam = 0: nothing corrected
    assert 0 <= protected["cfp/math/adapter_residual"] < 1


def saved_lora_checkpoint(directory, **config):
    """(base weights float64, anchor, trained PeftModel, directory): theta0 saved at bind, then training."""
    weights, anchor, peft_model = lora_model(modules_to_save=["lm_head"], **config)
    save_theta0(CFPState(peft_model, anchor), directory)
    train_a_little(peft_model)
    return weights, anchor, peft_model, directory


@pytest.mark.parametrize("config", [{}, {"init_lora_weights": "pissa"}], ids=["lora", "pissa"])
def test_resuming_restores_the_lora_factors_at_train_begin(tmp_path, config):
    """Restored on the trained model, the origin is the factors at bind (B0 A0 != 0 for PiSSA), not the
    current ones: the metrics are those of the merged model against the base weights (float64 reference)."""
    weights, anchor, peft_model, directory = saved_lora_checkpoint(tmp_path, **config)
    restored = CFPState(peft_model, anchor, theta0=SavedTheta0(directory))
    reference = merged_reference(peft_model, weights, anchor, [*ADAPTED, "lm_head.weight"])
    assert_metrics_match(restored.drift_metrics(), reference)
    assert all(v == 0 for v in CFPState(peft_model, anchor).drift_metrics().values())  # a fresh bind: no drift


def test_resuming_without_saved_lora_factors_is_refused_naming_the_weight(tmp_path):
    _, anchor, peft_model = lora_model(modules_to_save=["lm_head"])
    lm_anchor = FisherAnchor({"lm_head.weight": anchor.fisher["lm_head.weight"]}, name="math")
    save_theta0(CFPState(peft_model, lm_anchor), tmp_path)  # a run whose anchor covered no adapted weight
    with pytest.raises(
        CFPError,
        match=r"no LoRA factors at train begin for the adapted weight "
        r"'model.layers.0.self_attn.q_proj.weight'.*restart_path_on_resume=True",
    ):
        CFPState(peft_model, anchor, theta0=SavedTheta0(tmp_path))


def test_resuming_with_other_adapters_is_refused_naming_the_weight(tmp_path):
    saved_lora_checkpoint(tmp_path)
    _, anchor, other_rank = lora_model(r=2, modules_to_save=["lm_head"])
    with pytest.raises(
        CFPError,
        match=r"B \(16, 4\), A \(4, 16\) of adapter 'default' for "
        r"'model.layers.0.self_attn.q_proj.weight'; the model's are B \(16, 2\), A \(2, 16\)",
    ):
        CFPState(other_rank, anchor, theta0=SavedTheta0(tmp_path))
    _, anchor, renamed = lora_model()
    renamed.add_adapter("other", LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    renamed.base_model.set_adapter("other")
    with pytest.raises(
        CFPError,
        match=r"adapters \['default'\] for 'model.layers.0.self_attn.q_proj.weight'; "
        r"the model has the active adapters \['other'\]",
    ):
        CFPState(renamed, anchor, theta0=SavedTheta0(tmp_path))


def test_adapter_space_anchor_at_lora_init_has_zero_fisher_on_every_lora_a():
    """At PEFT's init B = 0, so dlogp/dA = s B^T g x^T = 0: an anchor estimated on the adapter protects no A."""
    tokenizer = tiny_tokenizer()
    peft_model = get_peft_model(tiny_llama(vocab_size=len(tokenizer)), LoraConfig(r=4, target_modules=["q_proj"]))
    anchor = estimate_fisher(peft_model, tokenizer, ["what is two plus three"], num_sequences=2, max_new_tokens=4)
    lora_a = [n for n in anchor.fisher if ".lora_A." in n]
    lora_b = [n for n in anchor.fisher if ".lora_B." in n]
    assert len(lora_a) == len(lora_b) == 2 and len(anchor.fisher) == 4  # the trainable parameters, PEFT-named
    assert all(torch.count_nonzero(anchor.fisher[n]) == 0 for n in lora_a)
    assert all(anchor.fisher[n].sum() > 0 for n in lora_b)
    state = CFPState(peft_model, anchor, free_fraction=0.5)  # binds as ordinary parameters: elementwise CFP
    assert not state.adapted and sorted(state.names) == sorted(anchor.fisher)
    before = {n: p.detach().clone() for n, p in peft_model.named_parameters() if p.requires_grad}
    train_a_little(peft_model)
    moved = {n: p.detach().clone() for n, p in peft_model.named_parameters() if p.requires_grad}
    state.correct(10.0)
    for name, param in peft_model.named_parameters():
        if param.requires_grad:
            fisher = anchor.fisher[name]
            expected = before[name] + (moved[name] - before[name]) / (1 + 10.0 * fisher)
            torch.testing.assert_close(param.detach(), expected)
            if ".lora_A." in name:
                assert torch.equal(param.detach(), moved[name])  # F = 0: A keeps the proposal


def test_fan_in_fan_out_layers_gpt2_conv1d_are_measured_and_corrected_in_w0_layout():
    """GPT-2's Conv1D stores W0 as (in x out), so Delta_W = (s B A)^T and F is read transposed."""
    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2))
    weights = {n: p.detach().double().clone() for n, p in base.named_parameters()}
    name = "transformer.h.0.attn.c_attn.weight"  # (16, 48): in x out
    columns = torch.rand(48, generator=torch.Generator().manual_seed(1)) * 4
    anchor = FisherAnchor({name: columns[None, :].expand(16, 48).contiguous()}, name="math")  # const. per output
    peft_model = get_peft_model(base, LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True))
    state = CFPState(peft_model, anchor)
    train_a_little(peft_model)
    assert_metrics_match(state.drift_metrics(), merged_reference(peft_model, weights, anchor, [name]))
    proposal = merged_weights(peft_model, [name])[name]
    state.correct(3.0)
    corrected = merged_weights(peft_model, [name])[name]
    target = weights[name] + (proposal - weights[name]) / (1 + 3.0 * anchor.fisher[name].double())
    assert float((corrected - target).norm() / (target - weights[name]).norm()) < 1e-5
