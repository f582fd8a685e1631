"""QLoRA: an anchor estimated on the full-precision base, on LoRA over the same base loaded by bitsandbytes.

bitsandbytes quantizes and runs 4-bit (and 8-bit) weights on the CPU, so nothing is mocked: a tiny Llama is
saved, reloaded quantized, and wrapped by PEFT. The drift reference is written here in float64 from the LoRA
factors, Delta_W = s B A - s0 B0 A0 (a 4-bit `merge_and_unload()` re-quantizes, so it cannot serve), and is
checked against the change of the layer's own output. `CFP_TEST_DEVICE=cuda` (scripts/gpu_check_peft.sh)
loads the quantized models on the GPU.
"""

import math
import os

import pytest
import torch
from support.extras import needs
from support.references import assert_metrics_match, drift_reference, train_a_little
from support.tiny import anchor_for, tiny_llama
from support.training import last_cfp_logs, short_run

needs("bitsandbytes", "peft")  # the `qlora` extra

from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import (  # noqa: E402
    BitsAndBytesConfig,
    LlamaForCausalLM,
    TrainerControl,
    TrainerState,
)

from hf_cfp import CFPCallback  # noqa: E402
from hf_cfp.anchor.fingerprint import check_fingerprint, model_fingerprint  # noqa: E402
from hf_cfp.errors import AnchorMismatchError  # noqa: E402
from hf_cfp.protection import CFPState, peft_view  # noqa: E402

DEVICE = os.environ.get("CFP_TEST_DEVICE", "cpu")
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("CFP_TEST_DEVICE=cuda but torch sees no CUDA device", allow_module_level=True)

ADAPTED = [f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(2) for p in "qv"]
QUANTIZATION = {
    "4bit": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32),
    "8bit": BitsAndBytesConfig(load_in_8bit=True),
}


def save_base(path, **config):
    """Save a tiny full-precision Llama to `path`; return its anchor, fingerprinted as estimate_fisher does."""
    base = tiny_llama(**config)
    base.save_pretrained(path)
    anchor = anchor_for(base, seed=1)
    anchor.metadata["base_fingerprint"] = model_fingerprint(base)
    return anchor


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(directory of the full-precision base, its anchor over every parameter)."""
    path = tmp_path_factory.mktemp("base")
    return path, save_base(path)


def quantized(path, bits="4bit"):
    """The model saved at `path`, loaded quantized on DEVICE."""
    return LlamaForCausalLM.from_pretrained(path, quantization_config=QUANTIZATION[bits], device_map=DEVICE)


def qlora_model(path, bits="4bit", seed=0):
    """The model saved at `path`, loaded quantized on DEVICE, with LoRA (r=4) on q_proj and v_proj (A seeded)."""
    model = quantized(path, bits)
    torch.manual_seed(seed)
    return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))


def lora_layers(peft_model):
    """Base-model name of the adapted weight -> its PEFT LoRA layer."""
    layers = peft_model.base_model.model.model.layers
    return {name: getattr(layers[int(name.split(".")[2])].self_attn, name.split(".")[4]) for name in ADAPTED}


def factors(peft_model):
    """name -> (s, B, A) of the default adapter, float64 on the CPU."""
    return {
        name: (
            layer.scaling["default"],
            layer.lora_B["default"].weight.detach().double().cpu(),
            layer.lora_A["default"].weight.detach().double().cpu(),
        )
        for name, layer in lora_layers(peft_model).items()
    }


@torch.no_grad()
def identity_outputs(peft_model):
    """name -> the layer's output on the identity: its effective weight transposed, dequant(W0)^T + s (BA)^T.

    Called in train mode (no dropout here): in eval mode under no_grad, bitsandbytes on a CPU with AVX512-BF16
    repacks 4-bit weights for a bf16 inference kernel that needs out_features % 32 == 0 (16 here) and rounds
    to bf16; train mode takes the dequantize-and-matmul path on every CPU."""
    was_training = peft_model.training
    peft_model.train()
    try:
        return {
            name: layer(torch.eye(layer.in_features, device=DEVICE)).double().cpu()
            for name, layer in lora_layers(peft_model).items()
        }
    finally:
        peft_model.train(was_training)


def factor_reference(at_bind, now, anchor, free_fraction=0.99):
    """float64 metrics of Delta_W = s B A - s0 B0 A0 over the adapted weights (the only ones that move)."""
    deltas = {n: now[n][0] * now[n][1] @ now[n][2] - at_bind[n][0] * at_bind[n][1] @ at_bind[n][2] for n in now}
    return drift_reference(deltas, anchor.fisher, anchor.name, free_fraction)


def begin(anchor, model):
    """What Trainer.train() does first: CFPCallback.on_train_begin (fingerprint check, then bind)."""
    callback = CFPCallback(anchor, lam=0.0)
    callback.on_train_begin(None, TrainerState(), TrainerControl(), model=model)
    return callback


def test_full_precision_anchor_binds_on_the_4bit_base(base):
    path, anchor = base
    peft_model = qlora_model(path)
    w0 = peft_model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    assert type(w0).__name__ == "Params4bit" and w0.shape != (16, 16)  # packed storage, logical 16 x 16
    state = CFPState(peft_model, anchor)
    assert [w.name for w in state.adapted] == ADAPTED
    assert state.names == []  # every base weight is frozen (the quantized ones are bound by logical shape)
    assert [w.name for w, _ in state.adapters.weights] == ADAPTED  # the anchor's correction covers them
    assert all(v == 0 for v in state.drift_metrics().values())


@pytest.mark.parametrize("bits, signature", [("4bit", "bnb-nf4[16,16]"), ("8bit", "bnb-int8[16,16]")])
def test_fingerprint_passes_on_the_quantized_base_comparing_names_and_logical_shapes(base, bits, signature):
    path, anchor = base
    peft_model = qlora_model(path, bits)
    fingerprint = anchor.metadata["base_fingerprint"]
    assert fingerprint["sampled_parameters"][1] == "model.layers.0.self_attn.v_proj.weight"  # quantized here
    check_fingerprint(fingerprint, peft_model, anchor.name, parameters=peft_view(peft_model).base)
    begin(anchor, peft_model)  # the callback's own check and bind
    own = model_fingerprint(quantized(path, bits))  # the quantized model's own fingerprint lists logical shapes
    assert own["num_parameters"] == fingerprint["num_parameters"]  # logical numel, not packed
    assert own["parameters"]["model.layers.0.self_attn.q_proj.weight"] == signature
    assert own["parameters"]["lm_head.weight"] == "float32[32,16]"  # left unquantized


def test_fingerprint_without_a_parameter_listing_checks_the_count_and_unquantized_samples(base, tmp_path, caplog):
    path, anchor = base
    unlisted = {**anchor.metadata["base_fingerprint"], "parameters": None}  # as for a base of > 4096 tensors
    peft_model = qlora_model(path)
    check_fingerprint(unlisted, peft_model, anchor.name, parameters=peft_view(peft_model).base)
    assert "names and shapes of this quantized model cannot be compared" in caplog.text
    save_base(tmp_path / "deeper", layers=3)
    deeper = qlora_model(tmp_path / "deeper")
    with pytest.raises(AnchorMismatchError, match="parameter count 6224"):
        check_fingerprint(unlisted, deeper, anchor.name, parameters=peft_view(deeper).base)
    save_base(tmp_path / "reseeded", seed=5)
    reseeded = qlora_model(tmp_path / "reseeded")
    with pytest.raises(AnchorMismatchError, match="sampled tensor 'lm_head.weight' differs"):
        check_fingerprint(unlisted, reseeded, anchor.name, parameters=peft_view(reseeded).base)


def test_fingerprint_refuses_a_4bit_base_of_other_shapes(base, tmp_path):
    path, anchor = base
    save_base(tmp_path, head_dim=16)  # q/k/v/o_proj 32 x 16 (16 x 32): the quantized weights alone differ
    other = qlora_model(tmp_path)
    with pytest.raises(AnchorMismatchError, match=r"k_proj.weight' is float32\[16,16\] .* but bnb-nf4\[32,16\]"):
        begin(anchor, other)
    with pytest.raises(AnchorMismatchError, match=r"q_proj.weight' has shape \(16, 16\) in the anchor but \(32, 16\)"):
        CFPState(other, anchor)  # binding compares logical shapes too


def test_fingerprint_refuses_a_4bit_base_of_other_names_or_weights(base, tmp_path):
    path, anchor = base
    save_base(tmp_path / "deeper", layers=3)
    with pytest.raises(AnchorMismatchError, match="parameters here are not in the anchor's base model.*layers.2"):
        begin(anchor, qlora_model(tmp_path / "deeper"))
    save_base(tmp_path / "reseeded", seed=5)  # same names and shapes: the unquantized lm_head's bytes differ
    with pytest.raises(AnchorMismatchError, match="different weights: sampled tensor 'lm_head.weight'"):
        begin(anchor, qlora_model(tmp_path / "reseeded"))


@pytest.mark.parametrize("bits", ["4bit", "8bit"])
def test_drift_equals_the_lora_factors_reference(base, bits):
    path, anchor = base
    peft_model = qlora_model(path, bits)
    train_a_little(peft_model, seed=1)  # B0 A0 != 0 at bind: the origin is subtracted
    at_bind, outputs_at_bind = factors(peft_model), identity_outputs(peft_model)
    state = CFPState(peft_model, anchor)
    train_a_little(peft_model, seed=2)
    assert_metrics_match(state.drift_metrics(), factor_reference(at_bind, factors(peft_model), anchor))
    moved = identity_outputs(peft_model)
    for weight in state.adapted:  # Delta_W is what the quantized layer's effective weight moved by
        effective = (moved[weight.name] - outputs_at_bind[weight.name]).T
        torch.testing.assert_close(weight.displacement().double().cpu(), effective, atol=1e-5, rtol=1e-4)


def test_trainer_run_on_the_4bit_base_logs_the_drift(base, tmp_path):
    path, anchor = base
    peft_model = qlora_model(path)
    at_bind = factors(peft_model)
    trainer = short_run(peft_model, tmp_path, [CFPCallback(anchor, lam=0.0)], use_cpu=DEVICE == "cpu")
    assert_metrics_match(last_cfp_logs(trainer), factor_reference(at_bind, factors(peft_model), anchor))


def lora_parameters(peft_model):
    return {n: p for n, p in peft_model.named_parameters() if "lora_" in n}


@pytest.mark.parametrize("rule", ["proximal_b", "least_squares_b", "factor_space"])
@pytest.mark.parametrize("bits", ["4bit", "8bit"])
def test_correction_on_the_quantized_base_equals_the_correction_on_the_full_precision_base(base, bits, rule):
    """The correction reads only the factors and F: over the same factors it must match plain LoRA's."""
    path, anchor = base
    qlora = qlora_model(path, bits)
    lora = get_peft_model(LlamaForCausalLM.from_pretrained(path), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in lora_parameters(lora).items():
            p.copy_(lora_parameters(qlora)[name])
    states = [CFPState(model, anchor, lora_rule=rule) for model in (qlora, lora)]
    train_a_little(qlora, seed=2)
    with torch.no_grad():
        for name, p in lora_parameters(lora).items():
            p.copy_(lora_parameters(qlora)[name])
    before = states[0].drift_metrics()["cfp/math/sensitive_drift"]
    for state in states:
        state.correct(5.0, measure_residual=True)
    for name, p in lora_parameters(lora).items():
        torch.testing.assert_close(lora_parameters(qlora)[name].detach().cpu(), p.detach(), msg=name)
    after = [state.drift_metrics() for state in states]
    assert after[0]["cfp/math/sensitive_drift"] == pytest.approx(after[1]["cfp/math/sensitive_drift"], rel=1e-5)
    assert after[0]["cfp/math/adapter_residual"] == pytest.approx(after[1]["cfp/math/adapter_residual"], rel=1e-4)
    assert after[0]["cfp/math/sensitive_drift"] < 0.8 * before


def test_trainer_run_with_a_large_lam_on_the_4bit_base_cuts_sensitive_drift(base, tmp_path):
    path, anchor = base
    free = last_cfp_logs(
        short_run(qlora_model(path), tmp_path / "free", [CFPCallback(anchor, lam=0.0)], use_cpu=DEVICE == "cpu")
    )
    protected = last_cfp_logs(
        short_run(qlora_model(path), tmp_path / "cfp", [CFPCallback(anchor, lam=1e3)], use_cpu=DEVICE == "cpu")
    )
    assert protected["cfp/math/sensitive_drift"] * 5 <= free["cfp/math/sensitive_drift"]
    assert math.isfinite(protected["cfp/math/adapter_residual"]) and protected["cfp/math/adapter_residual"] > 0
    assert "cfp/math/adapter_residual" not in free  # lam = 0: nothing corrected
