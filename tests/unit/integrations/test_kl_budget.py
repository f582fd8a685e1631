"""kl_budget: lam_t held by a controller on the measured KL (`hf_cfp.integrations.kl_control`).

Both rules against their closed forms: the feed-forward rule's targets against the measured KL (`kl_to_base` drawn
afresh from a copy of the base, an independent estimate of the same number) and the logged predicted KL, its lams
against the predicted KL they leave and its cap against the anchor's F; PPO's adaptive rule step by step. The
measured KL held within 25% of the budget on the tiny model from the first measurement above 3/4 of it, while the
unprotected run leaves it far behind; the callback's Trainer run against the loop API; exact resume from a
checkpoint and from `state_dict`; refused arguments."""

import copy
import json
import math
import shutil

import pytest
import torch
from support.anchors import random_anchor
from support.extras import needs
from support.tiny import tiny_llama
from support.training import CrashAfterSave, adamw_loop, checkpointed_run, full_batch_rows, full_batch_trainer_args
from transformers import Trainer

from hf_cfp import CFP, CFPCallback, CFPError, estimate_fisher, kl_to_base
from hf_cfp.errors import CFPArgumentError
from hf_cfp.evaluation import BaseResponses, draw_base_responses
from hf_cfp.integrations import kl_control
from hf_cfp.integrations.kl_control import STATE_FILE, controlled_lams, damped_targets

PROMPTS = [[1, 5, 7], [2, 9], [3, 4, 11, 12], [6, 8]]  # token ids: no tokenizer needed
DRAW = dict(num_samples_per_prompt=4, max_new_tokens=64, temperature=1.0, seed=0)  # kl_prompts' defaults


def test_the_rule_is_ppos_clipped_proportional_update():
    lams = controlled_lams([2.0, 2.0, 2.0, 2.0, 3.0], [0.15, 0.105, 0.0, 0.09, 0.1], [0.1] * 5)
    assert lams == pytest.approx([2.4, 2.1, 1.6, 1.8, 3.0])


def test_a_target_falls_at_once_and_rises_to_the_geometric_mean():
    assert damped_targets(None, [3.0, 0.5]) == [3.0, 0.5]  # the first measurement sets them
    assert damped_targets([4.0, 1.0, 2.0], [1.0, 4.0, 2.0]) == pytest.approx([1.0, 2.0, 2.0])


def test_each_measurement_is_the_kl_to_base_and_moves_lam_by_the_adaptive_rule():
    """kl_every=3 over 12 steps: lam stays between measurements; at each, the measured KL equals kl_to_base drawn
    again from a copy of the base with the same settings, and lam_new = lam_old (1 + clip(KL / B - 1, +-0.2))."""
    base, rows = tiny_llama(), full_batch_rows()
    model, budget = copy.deepcopy(base), 0.05
    protector = CFP(
        model, random_anchor(base), lam=0.5, kl_budget=budget, kl_prompts=draw(base), kl_every=3, kl_control="adaptive"
    )
    seen = []

    def after_step():
        before = list(protector.protection.lams)
        protector.step()
        seen.append((before, list(protector.protection.lams), protector.steps))
        if protector.steps % 3 == 0:
            reference = kl_to_base(base, model, None, PROMPTS, **DRAW)
            assert protector.measured[0].kl == pytest.approx(reference, rel=1e-9, abs=1e-12)
            assert protector.metrics()["cfp/math/measured_kl"] == protector.measured[0].kl
            expected = controlled_lams(before, [reference], [budget])
            assert protector.protection.lams == pytest.approx(expected, rel=1e-12)

    adamw_loop(model, rows, 12, after_step=after_step)
    assert seen[0][0] == [0.5]  # the start is lam
    moved = [after != before for before, after, _ in seen]
    assert moved == [step % 3 == 0 for _, _, step in seen]


def test_the_feedforward_rule_retargets_at_each_measurement_and_solves_every_step():
    """kl_every=4 over 12 steps: measured at 1, 2, 4, 8, 12. After the first measurement with KL > 0 the target
    is T = B / rho, rho = KL / Q (Q: the logged predicted KL, KL: kl_to_base from a copy of the base), after each
    later one B / rho where that is lower, else the geometric mean of the last T and B / rho; from then on
    each step's lam is its floor (`held`) with the predicted KL it leaves within T, or leaves it at T (the solve's
    1% tolerance), or is the cap (the random anchor's F is far from the model's: the ratio climbs, and the cap
    binds before step 12); before, lam is the start."""
    budget = 0.01
    base, rows, model, protector = feedforward_run(budget)
    control, measured, capped, target = protector.control, [], [], None

    def after_step():
        nonlocal target
        lams = protector.step()
        predicted = protector.metrics()["cfp/math/predicted_kl"]
        if target is None:
            assert lams == [0.5]
        elif lams[0] == control.held[0]:  # the floor binds
            assert predicted <= target * 1.01
        elif lams[0] == control.caps[0]:  # the cap binds: the target is not reached
            assert predicted > target
            capped.append(protector.steps)
        else:
            assert predicted == pytest.approx(target, rel=0.02)
        if control.due(protector.steps):
            measured.append(protector.steps)
            kl = kl_to_base(base, model, None, PROMPTS, **DRAW)
            assert protector.measured[0].kl == pytest.approx(kl, rel=1e-9, abs=1e-12)
            if kl > 0:
                new = budget * predicted / kl
                target = new if target is None else min(new, math.sqrt(target * new))
                assert control.targets == pytest.approx([target], rel=1e-6)

    adamw_loop(model, rows, 12, after_step=after_step)
    assert measured == [1, 2, 4, 8, 12] and target is not None and capped
    assert protector.metrics()["cfp/math/lam_capped"] == float(capped[-1] == 12)


@pytest.mark.parametrize(("budget", "moves"), [(1e-4, 1.2), (30.0, 0.8)])
def test_the_feedforward_floor_follows_the_adaptive_rule_at_every_kl_every_th_step(budget, moves):
    """kl_every=4 over 16 steps, measured at 1, 2, 4, 8, 12, 16: at 4, 8, 12 and 16 (not at the early 1 and 2) the
    floor is multiplied by 1 + clip(KL / B - 1, +-0.2) (KL: kl_to_base from a copy of the base), and every step's
    lam is at least the floor. Far above the budget it rises 20% each time, far below it falls 20%."""
    base, rows, model, protector = feedforward_run(budget)
    floor, factors = 0.5, []

    def after_step():
        nonlocal floor
        lams, step = protector.step(), protector.steps
        assert lams[0] >= floor * (1 - 1e-12) or lams[0] == protector.control.caps[0]
        if step % 4 == 0:
            kl = kl_to_base(base, model, None, PROMPTS, **DRAW)
            factors.append(1 + min(max(kl / budget - 1, -0.2), 0.2))
            floor *= factors[-1]
        assert protector.control.held == pytest.approx([floor], rel=1e-9)

    adamw_loop(model, rows, 16, after_step=after_step)
    assert factors == pytest.approx([moves] * 4)


def test_the_feedforward_cap_is_a_pull_of_max_pull_at_the_99th_percentile_of_f(monkeypatch):
    """With MAX_PULL small the cap binds: lam_t = MAX_PULL / p99(F) over the anchor's coordinates (a quantile of the
    concatenated F, against the anchor's streamed statistics), and the floor, which the KL far above the budget
    raises 20% at every measurement, stops at the cap."""
    monkeypatch.setattr(kl_control, "MAX_PULL", 1e-3)
    base, rows = tiny_llama(), full_batch_rows()
    anchor = random_anchor(base)
    model = copy.deepcopy(base)
    protector = CFP(
        model, anchor, lam=0.5, kl_budget=1e-4, kl_prompts=draw(base), kl_every=2, kl_control="feedforward"
    )
    lams = []
    adamw_loop(model, rows, 6, after_step=lambda: lams.append(protector.step()[0]))
    f = torch.cat([anchor.fisher[n].reshape(-1).double() for n, p in model.named_parameters() if n in anchor.fisher])
    cap = 1e-3 / torch.quantile(f, 0.99).item()
    assert lams[0] == 0.5 and lams[-1] == pytest.approx(cap, rel=1e-3)
    assert protector.metrics()["cfp/math/lam_capped"] == 1.0
    assert cap < 0.5 and protector.control.held == [protector.control.caps[0]]  # the start, raised, stopped there


UNMET_ON_THE_DIAGONAL = pytest.mark.xfail(
    strict=False,  # 1.2509 B: so near the bound that another CPU's rounding may meet it
    reason="peaks at 1.251 B (step 18), an overshoot on the approach to the budget: over 20 random tiny models the "
    "rule meets these bounds on 6 with the diagonal anchor and 9 with K-FAC, PPO's adaptive rule on 1 "
    "(scripts/kl_budget_seeds.py, docs/reports/strength.md)",
)


@pytest.mark.parametrize(
    "structure",
    [pytest.param(dict(structure="diagonal"), marks=UNMET_ON_THE_DIAGONAL), dict(structure="kfac", kfac_rank=4)],
)
def test_the_feedforward_rule_holds_the_measured_kl_within_a_quarter_of_the_budget(structure):
    """120 AdamW steps at lr 1e-2 on 8 rows, measured every 2 steps, with the tiny model's own Fisher on the prompts
    as the anchor (diagonal; K-FAC at rank 4 with tails): no measurement above 1.25 of a 0.5-nat budget, and every
    one within 25% of it from the first above 0.75 of it, while the same run without protection ends more than 20x
    above it. Met with the K-FAC anchor; with the diagonal one the rule misses it by 0.001 B (an expected failure that
    may pass where rounding differs)."""
    base, rows, budget = tiny_llama(), full_batch_rows(n=8), 0.5
    anchor = estimate_fisher(base, None, PROMPTS, num_sequences=32, max_new_tokens=16, name="math", **structure)
    responses = draw(base, num_samples_per_prompt=8, max_new_tokens=16)
    model = copy.deepcopy(base)
    protector = CFP(
        model, anchor, lam=1.0, kl_budget=budget, kl_prompts=responses, kl_every=2, kl_control="feedforward"
    )
    held = []

    def after_step():
        protector.step()
        if protector.control.due(protector.steps):
            held.append(protector.measured[0].kl)

    adamw_loop(model, rows, 120, after_step=after_step)
    reached = next(i for i, kl in enumerate(held) if kl > 0.75 * budget)
    assert max(held) <= 1.25 * budget and all(kl >= 0.75 * budget for kl in held[reached:]), held
    free = copy.deepcopy(base)
    adamw_loop(free, rows, 120)
    assert responses.kl(free).kl > 20 * budget


@pytest.mark.parametrize("rule", ["adaptive", "feedforward"])
def test_the_callback_draws_at_train_begin_and_follows_the_loop(tmp_path, rule):
    """CFPCallback(kl_budget, token-id kl_prompts) in a full-batch Trainer run ends where the loop API with the same
    options ends, and logs cfp/math/measured_kl once measured: from step 2 under the adaptive rule, from step 1
    under the feed-forward one."""
    base, rows = tiny_llama(), full_batch_rows()
    anchor = random_anchor(base)
    options = dict(lam=0.5, kl_budget=0.05, kl_prompts=PROMPTS, kl_every=2, kl_control=rule)
    trained = copy.deepcopy(base)
    trainer = Trainer(
        model=trained,
        args=full_batch_trainer_args(tmp_path, rows, 6),
        train_dataset=rows,
        callbacks=[CFPCallback(anchor, **options)],
    )
    trainer.train()
    looped = copy.deepcopy(base)
    protector = CFP(looped, anchor, **{**options, "kl_prompts": draw(base)})
    adamw_loop(looped, rows, 6, after_step=protector.step)
    for (name, p), q in zip(looped.named_parameters(), trained.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6), name
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert ("cfp/math/measured_kl" in logged[0]) == (rule == "feedforward") and "cfp/math/measured_kl" in logged[1]
    assert logged[-1]["cfp/math/measured_kl"] == pytest.approx(protector.measured[0].kl, rel=1e-4)
    assert logged[-1]["cfp/math/lam"] == pytest.approx(protector.protection.lams[0], rel=1e-4)


@pytest.mark.parametrize("rule", ["adaptive", "feedforward"])
def test_state_dict_resumes_the_controller_bit_for_bit(rule):
    """Measuring on the saved base responses (not ones drawn from the resumed weights) with the saved lams, and
    under the feed-forward rule its targets and floors (B = 30: the floor falls)."""
    base, rows = tiny_llama(), full_batch_rows()
    budget = 30.0 if rule == "feedforward" else 0.05
    anchor, options = random_anchor(base), dict(lam=0.5, kl_budget=budget, kl_every=2, kl_control=rule)
    kept = copy.deepcopy(base)
    protector = CFP(kept, anchor, kl_prompts=draw(base), **options)
    adamw_loop(kept, rows, 4, after_step=protector.step)
    saved = json.loads(json.dumps(protector.state_dict()["kl_control"]))  # JSON-ready
    state = {**protector.state_dict(), "kl_control": saved}
    halfway = copy.deepcopy(kept)
    adamw_loop(kept, rows, 4, after_step=protector.step)

    again = CFP(halfway, anchor, kl_prompts=draw(halfway), **options)  # drawn from the wrong weights: replaced
    again.load_state_dict(state)
    adamw_loop(halfway, rows, 4, after_step=again.step)
    assert all(torch.equal(a, b) for a, b in zip(halfway.parameters(), kept.parameters(), strict=True))
    assert again.protection.lams == protector.protection.lams
    assert again.control.held == protector.control.held and (rule == "adaptive" or again.control.held[0] < 0.5)


def run(output_dir, extra=(), resume=None, **callback_kwargs):
    """6 steps of the tiny Llama under kl_budget (measured every 2 steps), checkpoints every 2."""
    model = tiny_llama()
    cfp = CFPCallback(random_anchor(model), lam=0.5, kl_budget=0.05, kl_prompts=PROMPTS, kl_every=2, **callback_kwargs)
    params, _ = checkpointed_run(model, output_dir, [cfp, *extra], resume)
    return params, cfp


def test_resuming_a_checkpoint_keeps_the_base_responses_and_lams(tmp_path):
    straight, kept = run(tmp_path / "straight")
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "crashed", extra=[CrashAfterSave(4)])
    saved = json.loads((tmp_path / "crashed" / "checkpoint-4" / STATE_FILE).read_text())
    assert list(saved["responses"]) == ["math"] and len(saved["lams"]) == 1
    bare = tmp_path / "bare" / "checkpoint-4"
    shutil.copytree(tmp_path / "crashed" / "checkpoint-4", bare)
    resumed, cfp = run(tmp_path / "crashed", resume=True)
    assert all(torch.equal(resumed[n], straight[n]) for n in straight)
    assert cfp.cfp.protection.lams == kept.cfp.protection.lams

    (bare / STATE_FILE).unlink()
    with pytest.raises(CFPError, match="kl_budget.*restart_path_on_resume=True"):
        run(tmp_path / "bare-out", resume=str(bare))


def test_base_responses_survive_json_exactly():
    responses = draw(tiny_llama())
    again = BaseResponses.from_dict(json.loads(json.dumps(responses.to_dict())))
    assert torch.equal(again.base_log_probs, responses.base_log_probs)
    assert (again.prompts, again.responses, again.sampler) == (
        responses.prompts,
        responses.responses,
        responses.sampler,
    )
    assert (again.num_samples_per_prompt, again.pad_id, again.batch_size) == (4, responses.pad_id, 8)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(kl_budget=0.1), "kl_budget needs kl_prompts"),
        (dict(kl_prompts=PROMPTS), "kl_prompts is where kl_budget is measured"),
        (dict(kl_budget=0.1, kl_prompts=PROMPTS, kl_every=0), "kl_every must be an integer >= 1"),
        (dict(kl_budget=0.0, kl_prompts=PROMPTS), "kl_budget must be finite and > 0"),
        (dict(kl_budget=0.1, kl_prompts=PROMPTS, lam=0.0), "lam must be finite and > 0"),
        (dict(kl_budget=0.1, kl_prompts=PROMPTS, predicted_kl_budget=0.1), "without predicted_kl_budget"),
        (dict(kl_budget=0.1, kl_prompts=PROMPTS, lam=lambda step: 1.0), "a lam schedule"),
        (dict(kl_budget=0.1, kl_prompts={"code": PROMPTS}), r"names \['code'\]"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(CFPArgumentError, match=match):
        CFPCallback(random_anchor(tiny_llama()), **kwargs)


def test_text_prompts_in_the_loop_api_ask_for_drawn_responses():
    model = tiny_llama()
    with pytest.raises(CFPArgumentError, match="draw_base_responses"):
        CFP(model, random_anchor(model), kl_budget=0.1, kl_prompts=["What is 2 + 2?"])


def feedforward_run(budget):
    """The tiny Llama, its rows, a copy to train and the feed-forward rule on it from lam 0.5 with a random anchor,
    measured every 4 steps (and at 1, 2)."""
    base, rows = tiny_llama(), full_batch_rows()
    model = copy.deepcopy(base)
    protector = CFP(
        model,
        random_anchor(base),
        lam=0.5,
        kl_budget=budget,
        kl_prompts=draw(base),
        kl_every=4,
        kl_control="feedforward",
    )
    return base, rows, model, protector


def draw(model, **overrides):
    return draw_base_responses(model, None, PROMPTS, **{**DRAW, **overrides})


def test_lam_is_unknown_before_training():
    callback = CFPCallback(random_anchor(tiny_llama()), lam=0.5, kl_budget=0.1, kl_prompts=PROMPTS)
    with pytest.raises(CFPError, match="with kl_budget"):
        callback.lam_at(1)


def test_on_a_peft_model_the_controller_sets_the_lora_corrections_lam():
    """LoRA on q_proj and v_proj (the adaptive rule; the feed-forward one falls back to it there, as the predicted KL
    has no closed-form solve): the measured KL is the PeftModel's, and lam moves by the rule."""
    needs("peft")
    from peft import LoraConfig, get_peft_model

    base = tiny_llama()
    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    protector = CFP(
        model,
        random_anchor(base),
        lam=0.5,
        kl_budget=1e-6,
        kl_prompts=draw(base),
        kl_every=2,
        kl_control="feedforward",
    )
    assert protector.control.rule == "adaptive"
    adamw_loop(model, full_batch_rows(), 4, after_step=protector.step)
    reference = kl_to_base(base, model, None, PROMPTS, **DRAW)
    assert protector.measured[0].kl == pytest.approx(reference, rel=1e-9) and reference > 1e-6
    assert protector.protection.lams == pytest.approx([0.5 * 1.2 * 1.2])  # over budget at both measurements
