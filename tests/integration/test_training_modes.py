"""CFP under the Trainer's training modes, each against an independent reference.

- Gradient accumulation: one correction per optimizer step, same path as `ReferenceCFP`
  (tests/support/references.py).
- bf16 (``TrainingArguments(bf16=True, use_cpu=True)``: CPU autocast, float32 parameters) and a
  model cast to bf16: the correction is computed in float32 and written back once.
- fp16: ``TrainingArguments(fp16=True, use_cpu=True)`` is accepted on CPU but runs without a grad
  scaler (``trainer.accelerator.scaler is None``), so the Trainer never skips a step on CPU. A step
  skipped by the grad scaler is therefore tested in a plain loop with ``torch.amp.GradScaler("cpu")``.
  Behaviour (stated and asserted): the Trainer calls ``on_step_end`` for a skipped step too (it
  only holds back the lr scheduler), and CFP corrects it like any step. The optimizer left theta
  unchanged, so the step is a zero proposal and the correction is one more contraction toward
  theta0, theta <- theta0 + (theta - theta0) / (1 + lam F). The correction is not idempotent:
  applied twice it shrinks twice. This is the proximal step of a zero update (the displacement
  only gets smaller, never larger, and lam schedules stay keyed by `global_step`, which the
  Trainer advances for skipped steps as well).
- ``torch.compile``: names carry ``_orig_mod.``; an anchor keyed by plain names binds, and the run
  equals the uncompiled one. The `aot_eager` backend is used: it goes through Dynamo and AOTAutograd
  (same wrapper, same names) without inductor's C++ build, which took ~36 s for one forward and
  backward of the tiny model on this 2-core machine.
- Parameters added to the optimizer after bind: refused with CFPError.
- Frozen parameters: bit-identical after a Trainer run, while trainable ones move.
"""

import copy
from types import SimpleNamespace

import pytest
import torch
from support.anchors import random_anchor
from support.references import ReferenceCFP, StepReference
from support.tiny import tiny_llama
from support.training import lm_dataset, train
from transformers import TrainerCallback

from hf_cfp import CFPCallback
from hf_cfp.errors import CFPError
from hf_cfp.protection import CFPState


def max_diff(a, b):
    return max((a[n] - b[n]).abs().max().item() for n in a)


class CountCorrections:
    """Wraps CFPState.correct to count calls (monkeypatched on the class)."""

    def __init__(self, monkeypatch):
        self.calls = []
        original = CFPState.correct

        def counting(state, lam, **kwargs):
            self.calls.append(lam)
            return original(state, lam, **kwargs)

        monkeypatch.setattr(CFPState, "correct", counting)


class StepCounter(TrainerCallback):
    def __init__(self):
        self.steps = self.substeps = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1

    def on_substep_end(self, args, state, control, **kwargs):
        self.substeps += 1


def test_gradient_accumulation_corrects_once_per_optimizer_step(tmp_path, monkeypatch):
    base = tiny_llama()
    anchor = random_anchor(base)

    def lam(step):  # a schedule shows which steps were corrected
        return 2.0 * step

    counter, steps = CountCorrections(monkeypatch), StepCounter()
    ours = train(
        copy.deepcopy(base),
        [CFPCallback(anchor, lam=lam), steps],
        tmp_path / "ours",
        steps=4,
        gradient_accumulation_steps=2,
    )
    reference = train(
        copy.deepcopy(base),
        [ReferenceCFP(anchor.fisher, lam)],
        tmp_path / "ref",
        steps=4,
        gradient_accumulation_steps=2,
    )
    plain = train(copy.deepcopy(base), [], tmp_path / "plain", steps=4, gradient_accumulation_steps=2)
    # 8 micro-batches of 4 (two epochs of 16): 4 optimizer steps, 4 substeps
    assert (steps.steps, steps.substeps) == (4, 4)
    assert counter.calls == [[2.0], [4.0], [6.0], [8.0]]  # once per optimizer step, with lam(global_step)
    assert max_diff(ours, reference) <= 1e-6
    assert max_diff(ours, plain) > 1e-3


def test_bf16_autocast_trainer_matches_reference(tmp_path):
    """bf16 autocast, float32 parameters: each step's correction equals the float64 formula on
    that step's proposal within float32 rounding, whatever bf16 kernels the CPU has."""
    base = tiny_llama()
    anchor = random_anchor(base)
    check = StepReference(anchor.fisher, 10.0)
    ours = train(copy.deepcopy(base), [CFPCallback(anchor, lam=10.0), check], tmp_path / "ours", bf16=True)
    plain = train(copy.deepcopy(base), [], tmp_path / "plain", bf16=True)
    assert all(p.dtype == torch.float32 for p in ours.values())  # autocast: float32 master weights
    assert check.steps == 5 and check.checked == 5 * len(ours)
    assert check.violations == 0, f"largest gap {check.largest_gap_over_bound:.2f} x the float32 bound"
    # The effect is large against that bound: lam = 10 ends 0.096 (max abs) from the plain run (measured).
    assert max_diff(ours, plain) > 1e-3


def test_bf16_model_is_corrected_in_float32_against_float64_reference(tmp_path):
    """A model cast to bf16: the correction is computed in float32 and rounded to bf16 once, so each
    element is within one bf16 ulp of the float64 formula (computing it in bf16 arithmetic instead
    misses by ~0.1 relative, 24 of 105 tensor-steps identical)."""
    base = tiny_llama().to(torch.bfloat16)
    anchor = random_anchor(base)
    check = StepReference(anchor.fisher, 3.0)
    final = train(copy.deepcopy(base), [CFPCallback(anchor, lam=3.0), check], tmp_path / "ours")
    assert all(p.dtype == torch.bfloat16 for p in final.values())
    assert check.steps == 5
    assert check.violations == 0, f"largest gap {check.largest_gap_over_bound:.2f} x the bf16 bound"
    # Measured 104 of 105 tensor-steps bit-identical to the rounded float64 result; an rounding flip
    # at a bf16 tie is allowed by the bound above, and many of them would mean bf16 arithmetic.
    assert check.exact >= 0.9 * check.checked


def test_step_skipped_by_grad_scaler_is_still_corrected_once():
    """A plain fp16-style loop with torch.amp.GradScaler("cpu"): an inf gradient makes
    scaler.step skip the optimizer; the correction that follows (as the Trainer's on_step_end
    would run it) is one contraction of the unchanged theta toward theta0."""
    model = tiny_llama()
    anchor = random_anchor(model)
    state = CFPState(model, anchor)
    theta0 = {n: p.detach().double() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    ids = lm_dataset(n=4)[0]["input_ids"].unsqueeze(0)
    lam = 2.0

    def step(poison):
        optimizer.zero_grad()
        scaler.scale(model(input_ids=ids, labels=ids).loss).backward()
        if poison:
            next(model.parameters()).grad.fill_(float("inf"))
        scaler.step(optimizer)
        scaler.update()
        before = {n: p.detach().double() for n, p in model.named_parameters()}
        state.correct(lam)
        return before

    step(poison=False)  # a real step: theta moves off theta0
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    proposal = step(poison=True)
    assert scaler.get_scale() == 2.0**3  # the scaler saw the inf and backed off: the step was skipped
    for n, p in model.named_parameters():
        assert torch.equal(proposal[n].float(), before[n])  # the optimizer did not move theta
        t0 = theta0[n]
        expected = t0 + (proposal[n] - t0) / (1 + lam * anchor.fisher[n].double())
        assert (p.double() - expected).abs().max().item() <= 1e-6
    # Not idempotent: the skipped step shrank the displacement once more where F > 0, and left
    # F = 0 coordinates exactly where the optimizer had them.
    after = sum((p.double() - theta0[n]).abs().sum().item() for n, p in model.named_parameters())
    displaced = sum((before[n].double() - theta0[n]).abs().sum().item() for n in before)
    assert after < 0.9 * displaced
    for n, p in model.named_parameters():
        free = anchor.fisher[n] == 0
        assert torch.equal(p[free], before[n][free])


def test_torch_compile_model_with_plain_name_anchor_matches_uncompiled(tmp_path):
    base = tiny_llama()
    anchor = random_anchor(base)  # keyed by plain names
    compiled = torch.compile(copy.deepcopy(base), backend="aot_eager")
    assert any(n.startswith("_orig_mod.") for n, _ in compiled.named_parameters())
    torch._dynamo.reset()
    ours = train(
        compiled, [CFPCallback(anchor, lam=10.0)], tmp_path / "compiled", steps=3, remove_unused_columns=False
    )  # the compiled forward's signature is (*args, **kwargs)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # the Trainer ran the compiled graph
    plain_names = {n.removeprefix("_orig_mod."): p for n, p in ours.items()}
    uncompiled = train(copy.deepcopy(base), [CFPCallback(anchor, lam=10.0)], tmp_path / "eager", steps=3)
    unprotected = train(copy.deepcopy(base), [], tmp_path / "plain", steps=3)
    assert set(plain_names) == set(uncompiled)
    assert max_diff(plain_names, uncompiled) <= 1e-5
    assert max_diff(uncompiled, unprotected) > 1e-3


class AddParamGroup(TrainerCallback):
    """Adds a fresh parameter to the optimizer at the end of step `at` (a model grown mid-training),
    before CFPCallback's on_step_end runs (it is listed first). Adding it earlier in the step
    breaks the Trainer's lr scheduler (one base lr per group) before CFP could say anything."""

    def __init__(self, at):
        self.at = at

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        if state.global_step == self.at:
            optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})


def test_parameters_added_to_the_optimizer_after_bind_are_refused(tmp_path):
    base = tiny_llama()
    callback = CFPCallback(random_anchor(base), lam=1.0)
    with pytest.raises(CFPError, match=r"\+1 parameter, \+1 group\).*before trainer.train\(\)"):
        train(base, [AddParamGroup(at=1), callback], tmp_path, steps=4)
    # at=1: the refusal at the first step's end shows the size was recorded at train begin,
    # from the optimizer the Trainer passes there, not lazily at the first step.
    assert callback.protection is not None


def test_parameters_added_in_a_plain_loop_are_refused():
    """The hooks called by hand, as a custom loop would: a parameter appended to an existing group."""
    model = tiny_llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    callback = CFPCallback(random_anchor(model), lam=1.0)

    def at_step(step):
        return SimpleNamespace(global_step=step)

    callback.on_train_begin(None, at_step(0), None, model=model, optimizer=optimizer)
    callback.on_step_end(None, at_step(1), None, optimizer=optimizer)  # unchanged: corrected, no error
    optimizer.param_groups[0]["params"].append(torch.nn.Parameter(torch.zeros(2)))
    message = r"now has 22 parameters in 1 param group, but had 21 in 1 .*\(\+1 parameter, \+0 groups\)"
    with pytest.raises(CFPError, match=message):
        callback.on_step_end(None, at_step(2), None, optimizer=optimizer)


class MoveFrozenAfterBind(TrainerCallback):
    """Before the first step, after CFP took theta0 at train begin, shifts every frozen parameter by
    `shift`: a frozen parameter then sits away from its theta0, so pulling it toward theta0 would
    change it (at theta0 the pull is a no-op, and a test of 'left alone' could not fail)."""

    def __init__(self, cfp, shift=0.5):
        self.cfp, self.shift, self.moved = cfp, shift, None

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step == 0:
            assert self.cfp.protection is not None, "CFP binds at train begin, before the first step"
            with torch.no_grad():
                for p in model.parameters():
                    if not p.requires_grad:
                        p.add_(self.shift)
            self.moved = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}


def test_frozen_parameters_stay_bit_identical(tmp_path):
    model = tiny_llama()
    anchor = random_anchor(model)  # covers frozen parameters too: they must be skipped, not pulled
    for p in model.model.layers[0].parameters():
        p.requires_grad_(False)
    theta0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert len(frozen) == 9
    cfp = CFPCallback(anchor, lam=10.0)
    mover = MoveFrozenAfterBind(cfp)
    final = train(model, [cfp, mover], tmp_path)
    assert mover.moved is not None and set(mover.moved) == frozen
    # away from theta0 wherever F > 0, where a pull toward theta0 (lam F = 10 F) would move them
    for n in frozen:
        away = (mover.moved[n] != theta0[n]) & (anchor.fisher[n] > 0)
        assert away.sum() > 0.5 * away.numel(), n
    # left alone after the shift: name -> how far a frozen parameter moved (none may)
    pulled = {
        n: (final[n] - mover.moved[n]).abs().max().item() for n in frozen if not torch.equal(final[n], mover.moved[n])
    }
    assert not pulled, pulled
    moved = [n for n in final if n not in frozen and not torch.equal(final[n], theta0[n])]
    assert len(moved) == len(final) - len(frozen)  # every trainable tensor moved
    # the metrics cover the trainable parameters only: the shifted frozen ones add nothing
    assert set(cfp.protection.names) == set(final) - frozen
