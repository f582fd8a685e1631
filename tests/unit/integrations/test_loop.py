"""The loop API `CFP` against CFPCallback in a Trainer run, and its state_dict round trip."""

import copy
import runpy
from pathlib import Path

import pytest
import torch
from support.anchors import random_anchor
from support.extras import needs
from support.references import drift_reference
from support.tiny import tiny_llama
from support.training import adamw_loop, full_batch_rows, full_batch_trainer_args
from transformers import Trainer

from hf_cfp import CFP, CFPCallback, FisherAnchor
from hf_cfp.errors import CFPError

STEPS, LAM = 4, 10.0
EXAMPLE = Path(__file__).parents[3] / "scripts" / "examples" / "accelerate_loop.py"


def test_loop_api_follows_the_callbacks_trainer_run(tmp_path):
    """A plain AdamW loop with `protector.step()` after each optimizer step ends where the Trainer with
    CFPCallback ends (the same full-batch run), and `metrics()` equals the float64 drift reference."""
    base, rows = tiny_llama(), full_batch_rows()
    anchor = random_anchor(base)
    trained = copy.deepcopy(base)
    args = full_batch_trainer_args(tmp_path, rows, STEPS)
    Trainer(model=trained, args=args, train_dataset=rows, callbacks=[CFPCallback(anchor, lam=LAM)]).train()

    looped = copy.deepcopy(base)
    protector = CFP(looped, anchor, lam=LAM)
    adamw_loop(looped, rows, STEPS, after_step=protector.step)
    plain = copy.deepcopy(base)
    adamw_loop(plain, rows, STEPS)
    for (name, p), q in zip(looped.named_parameters(), trained.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6), name
    assert max((p - r).abs().max().item() for p, r in zip(looped.parameters(), plain.parameters(), strict=True)) > 1e-3
    assert protector.steps == STEPS
    theta0 = dict(base.named_parameters())
    deltas = {n: p.detach() - theta0[n].detach() for n, p in looped.named_parameters()}
    metrics = {k: v for k, v in protector.metrics().items() if not k.endswith("/lam")}
    reference = drift_reference(deltas, anchor.fisher, "math")
    assert metrics.keys() == reference.keys()
    assert all(metrics[k] == pytest.approx(v, rel=1e-5) for k, v in reference.items())


def test_state_dict_resumes_the_same_path_bit_for_bit():
    """Two steps, state_dict, a fresh CFP on a model holding those weights, load_state_dict, two more steps: the
    same weights, bit for bit, as one CFP object kept across the two halves (each half a fresh AdamW, as
    `adamw_loop` builds one per call); without the state_dict the path restarts at step 2 and ends elsewhere."""
    base, rows = tiny_llama(), full_batch_rows()
    anchor = random_anchor(base)
    kept = copy.deepcopy(base)
    protector = CFP(kept, anchor, lam=LAM)
    adamw_loop(kept, rows, 2, after_step=protector.step)
    saved = protector.state_dict()
    halfway = copy.deepcopy(kept)
    adamw_loop(kept, rows, 2, after_step=protector.step)
    assert saved["steps"] == 2 and all(t.device.type == "cpu" for t in saved["theta0"].values())

    resumed, restarted = copy.deepcopy(halfway), copy.deepcopy(halfway)
    again = CFP(resumed, anchor, lam=LAM)
    again.load_state_dict(saved)
    assert again.steps == 2
    adamw_loop(resumed, rows, 2, after_step=again.step)
    adamw_loop(restarted, rows, 2, after_step=CFP(restarted, anchor, lam=LAM).step)
    assert all(torch.equal(a, b) for a, b in zip(resumed.parameters(), kept.parameters(), strict=True))
    gap = max((a - b).abs().max().item() for a, b in zip(restarted.parameters(), kept.parameters(), strict=True))
    assert gap > 1e-4  # the saved theta0 matters


def test_state_dict_of_a_lora_run_resumes_the_same_path_bit_for_bit():
    """On a PeftModel (LoRA on q_proj and v_proj), the state_dict carries the LoRA factors at train begin (s0, B0,
    A0, on the CPU) besides theta0: the resumed run ends bit for bit where the uninterrupted one ends, while a run
    that starts CFP afresh at the halfway weights (factors B0 = B at step 2) ends elsewhere."""
    needs("peft")
    from peft import LoraConfig, get_peft_model

    base, rows = tiny_llama(), full_batch_rows()
    anchor = random_anchor(base)
    kept = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    protector = CFP(kept, anchor, lam=LAM)
    assert protector.protection.adapted  # the adapted weights are corrected through their factors
    adamw_loop(kept, rows, 2, after_step=protector.step)
    saved = protector.state_dict()
    halfway = copy.deepcopy(kept)
    adamw_loop(kept, rows, 2, after_step=protector.step)
    factors = [t for snapshot in saved["lora0"].values() for _, b0, a0 in snapshot for t in (b0, a0)]
    assert len(saved["lora0"]) == len(protector.protection.adapted) and all(t.device.type == "cpu" for t in factors)
    assert all(float(b0.abs().max()) == 0 for snapshot in saved["lora0"].values() for _, b0, _ in snapshot)

    resumed, restarted = copy.deepcopy(halfway), copy.deepcopy(halfway)
    again = CFP(resumed, anchor, lam=LAM)
    again.load_state_dict(saved)
    adamw_loop(resumed, rows, 2, after_step=again.step)
    adamw_loop(restarted, rows, 2, after_step=CFP(restarted, anchor, lam=LAM).step)
    assert all(torch.equal(a, b) for a, b in zip(resumed.parameters(), kept.parameters(), strict=True))
    gap = max((a - b).abs().max().item() for a, b in zip(restarted.parameters(), kept.parameters(), strict=True))
    assert gap > 1e-3, gap  # the saved factors matter (0.015 here)


def test_state_dict_for_another_model_is_a_clear_error():
    base = tiny_llama()
    anchor = random_anchor(base)
    protector = CFP(copy.deepcopy(base), anchor, lam=LAM)
    state = protector.state_dict()
    state["theta0"].pop(next(iter(state["theta0"])))
    with pytest.raises(CFPError, match="No theta0 for .* in the CFP state_dict"):
        protector.load_state_dict(state)
    assert isinstance(protector.anchors[0], FisherAnchor)


def test_the_accelerate_loop_example_runs_and_reports_the_drift_of_its_path():
    """scripts/examples/accelerate_loop.py as written: five protected steps, and its last metrics equal the float64
    drift of its final weights from a fresh tiny_llama() (its theta0)."""
    namespace = runpy.run_path(str(EXAMPLE), run_name="__main__")
    assert namespace["protector"].steps == 5
    theta0 = dict(tiny_llama().named_parameters())
    model = namespace["accelerator"].unwrap_model(namespace["model"])
    deltas = {n: p.detach() - theta0[n].detach() for n, p in model.named_parameters()}
    reference = drift_reference(deltas, namespace["anchor"].fisher, "math")
    metrics = namespace["metrics"]
    assert all(metrics[k] == pytest.approx(v, rel=1e-5) for k, v in reference.items())
