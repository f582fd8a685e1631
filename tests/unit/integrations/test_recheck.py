"""Anchor staleness: re-estimating at unchanged weights reproduces the anchor bit for bit (overlap 1), the
overlap against a plain top-k set intersection, and in a Trainer run the logged top1_overlap_now equals a
re-estimate of a copy of the model taken at that step; refresh_fisher swaps F and keeps theta0."""

import copy

import pytest
import torch
from support.tiny import tiny_llama
from support.training import train
from transformers import TrainerCallback

from hf_cfp import CFPCallback, estimate_fisher
from hf_cfp.errors import CFPArgumentError
from hf_cfp.fisher.staleness import reestimate, top1_overlap

PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
SIZES = dict(num_sequences=4, max_new_tokens=3, seed=5, temperature=0.8, show_progress=False)


def test_unchanged_weights_reproduce_the_anchor_and_overlap_is_one():
    model = tiny_llama()
    anchor = estimate_fisher(model, None, PROMPTS, name="math", **SIZES)
    fresh = reestimate(anchor, model, None, PROMPTS)
    assert fresh.name == "math_now" and fresh.fisher.keys() == anchor.fisher.keys()
    assert all(torch.equal(fresh.fisher[n], anchor.fisher[n]) for n in anchor.fisher)
    assert top1_overlap(anchor, fresh) == 1.0


def test_overlap_after_moving_matches_a_plain_top_k_intersection():
    model = tiny_llama()
    anchor = estimate_fisher(model, None, PROMPTS, name="math", **SIZES)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    fresh = reestimate(anchor, model, None, PROMPTS)
    a = torch.cat([anchor.fisher[n].reshape(-1) for n in anchor.fisher])
    b = torch.cat([fresh.fisher[n].reshape(-1) for n in anchor.fisher])
    k = -(-a.numel() // 100)
    expected = len(set(a.topk(k).indices.tolist()) & set(b.topk(k).indices.tolist())) / k
    overlap = top1_overlap(anchor, fresh)
    assert overlap == pytest.approx(expected, abs=1 / k)  # ties at the k-th value may break either way
    assert overlap < 1.0


def test_trainer_logs_the_overlap_at_recheck_steps_and_refresh_keeps_theta0(tmp_path):
    base = tiny_llama()
    theta0 = {n: p.detach().clone() for n, p in base.named_parameters()}
    anchor = estimate_fisher(base, None, PROMPTS, name="math", **SIZES)
    snapshots, logged = {}, {}

    class Watch(TrainerCallback):  # after CFP in the list: sees the corrected, rechecked model and its metrics
        def on_step_end(self, args, state, control, model=None, **kwargs):
            snapshots[state.global_step] = copy.deepcopy(model)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                logged[state.global_step] = logs.get("cfp/math/top1_overlap_now")

    callback = CFPCallback(anchor, lam=1.0, recheck_every=2, recheck_prompts=PROMPTS, refresh_fisher=True)
    train(base, [callback, Watch()], tmp_path, steps=4)
    assert logged[1] is None and logged[3] is None
    for step in (2, 4):
        expected = top1_overlap(anchor, reestimate(anchor, snapshots[step], None, PROMPTS))
        assert logged[step] == expected
    fresh_now = reestimate(anchor, snapshots[4], None, PROMPTS)
    state = callback.protection
    protected = state.diagonal.protected.tensors
    assert all(torch.equal(t.fisher[state.protecting[0]], fresh_now.fisher[t.name]) for t in protected)
    assert not all(torch.equal(t.fisher[state.protecting[0]], anchor.fisher[t.name]) for t in protected)
    assert all(torch.equal(t0, theta0[name]) for name, t0 in zip(state.names, state.theta0, strict=True))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(recheck_every=2), "needs recheck_prompts"),
        (dict(recheck_prompts=PROMPTS), "need recheck_every"),
        (dict(refresh_fisher=True), "need recheck_every"),
        (dict(recheck_every=0, recheck_prompts=PROMPTS), "integer >= 1"),
        (dict(recheck_every=2, recheck_prompts={"code": PROMPTS}), "protecting anchors are"),
    ],
)
def test_bad_recheck_arguments_are_refused(kwargs, match):
    anchor = estimate_fisher(tiny_llama(), None, PROMPTS, name="math", **SIZES)
    with pytest.raises(CFPArgumentError, match=match):
        CFPCallback(anchor, **kwargs)
