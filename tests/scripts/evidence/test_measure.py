"""CapabilityProbe on the tiny pipeline model: the base model measures exactly zero KL and zero task progress,
and a perturbed model's task numbers equal a plain reference written here: one unbatched float64 forward per
(prompt, answer), the prompt through the chat template, the answer's tokens without special tokens; an RL arm's
reward gain is the sampled reward of the model minus the base model's (`rewards.sampled_rewards`)."""

import copy

import pytest
import torch
from support.extras import needs

needs("trl", "datasets")

from evidence.measure import CapabilityProbe  # noqa: E402
from evidence.plan import DOMAINS, TINY  # noqa: E402
from evidence.rewards import sampled_rewards  # noqa: E402
from evidence.run import tiny_model_and_tokenizer  # noqa: E402
from support.references import train_a_little  # noqa: E402


def sequence_log_prob(model, tokenizer, prompt: str, answer: str) -> tuple[float, int]:
    """(sum_t log pi(a_t | x, a_<t), |a|) from one forward of the whole sequence, in float64."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([prompt_ids + answer_ids])
    with torch.no_grad():
        log_p = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)
    total = sum(float(log_p[len(prompt_ids) + t - 1, token]) for t, token in enumerate(answer_ids))
    return total, len(answer_ids)


@pytest.fixture(scope="module")
def probe_and_models():
    torch.manual_seed(0)
    base, tokenizer = tiny_model_and_tokenizer()
    probe = CapabilityProbe(base, tokenizer, TINY)
    moved = copy.deepcopy(base)
    with torch.no_grad():
        train_a_little(moved, scale=0.05)
    return probe, base, moved, tokenizer


def test_the_base_model_measures_zero_kl_and_zero_task_progress(probe_and_models):
    probe, base, _, _ = probe_and_models
    row = probe.measure(base, greedy=True)
    for domain in DOMAINS:
        assert row[f"{domain}/kl"] == 0.0 and row[f"{domain}/kl_stderr"] == 0.0
    assert row["task/sft_gain"] == 0.0 and row["task/dpo_margin"] == 0.0 and row["task/dpo_accuracy"] == 0.0
    assert 0.0 <= row["math/exact_match"] <= 1.0 and 0.0 <= row["safety/refusal_rate"] <= 1.0


def test_task_progress_matches_a_plain_forward_per_item(probe_and_models):
    probe, base, moved, tokenizer = probe_and_models
    row = probe.measure(moved, greedy=False)
    assert "math/exact_match" not in row and "safety/refusal_rate" not in row

    gains = []
    for prompt, response in probe.sft_pairs:
        (after, n), (before, _) = (sequence_log_prob(m, tokenizer, prompt, response) for m in (moved, base))
        gains.append((after - before) / n)
    margins = []
    for prompt, chosen, rejected in probe.triples:
        c1, r1 = (sequence_log_prob(moved, tokenizer, prompt, a)[0] for a in (chosen, rejected))
        c0, r0 = (sequence_log_prob(base, tokenizer, prompt, a)[0] for a in (chosen, rejected))
        margins.append((c1 - c0) - (r1 - r0))
    assert row["task/sft_gain"] == pytest.approx(sum(gains) / len(gains), rel=1e-4, abs=1e-6)
    assert row["task/dpo_margin"] == pytest.approx(sum(margins) / len(margins), rel=1e-4, abs=1e-6)
    assert row["task/dpo_accuracy"] == sum(m > 0 for m in margins) / len(margins)
    assert row["task/sft_gain"] != 0.0  # the perturbation moved the model


def test_kl_of_a_moved_model_is_the_mean_log_ratio_of_the_stored_base_responses(probe_and_models):
    probe, _, moved, _ = probe_and_models
    row = probe.measure(moved, greedy=False)
    for domain in DOMAINS:
        stored = probe.base_responses[domain]
        expected = float((stored.base_log_probs - stored.log_probs(moved)).mean())
        assert row[f"{domain}/kl"] == pytest.approx(expected, rel=1e-12)
        assert row[f"{domain}/kl_stderr"] > 0


def test_rl_task_progress_is_the_sampled_reward_gain_over_the_base(probe_and_models):
    probe, base, moved, tokenizer = probe_and_models
    assert "task/pirate_gain" not in probe.measure(base, greedy=False)  # only with rewards=True (RL arms)
    row = probe.measure(base, greedy=False, rewards=True)
    assert row["task/pirate_gain"] == 0.0 and row["task/brevity_gain"] == 0.0  # the same seeded completions
    after = probe.measure(moved, greedy=False, rewards=True)
    prompts = [p for p, _ in probe.sft_pairs]
    now = sampled_rewards(moved, tokenizer, prompts, TINY.rl_eval_samples, TINY.rl_completion_tokens)
    before = sampled_rewards(base, tokenizer, prompts, TINY.rl_eval_samples, TINY.rl_completion_tokens)
    for name in ("pirate", "brevity"):
        assert after[f"task/{name}_reward"] == now[name]
        assert after[f"task/{name}_gain"] == now[name] - before[name]
    assert after["task/brevity_gain"] != 0.0  # the perturbation changed the completions
