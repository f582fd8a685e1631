"""Everything measured on a trained model that does not come from an anchor: per capability, the KL to the
base on held-out prompts and the capability's own scores; for the task, how far training got.

Per domain d in (math, code, safety), on the bundled held-out set (`eval_items(d)`, disjoint from the
calibration prompts):

- `<d>/kl`, `<d>/kl_stderr`: KL(mu_0 || mu_theta) on the first `kl_prompts` prompts, `kl_samples` base
  responses each, drawn once from the base model (`draw_base_responses`, seed 0);
- `<d>/log_lik`: `reference_log_likelihood` of the reference answers (math: the number; code: HumanEval's
  canonical solution; safety: a short refusal), nats per token;
- with `greedy`: `math/exact_match` (`greedy_exact_match`) and `safety/refusal_rate` (`refusal_rate`).

The task (the pirate-style pairs, base log-probs taken once):

- `task/sft_gain` = (1/N) sum_i [ LL_theta(y_i|x_i) - LL_0(y_i|x_i) ] per token, the SFT targets' gain;
- `task/dpo_margin` = (1/N) sum_i [ (l_theta(c_i) - l_0(c_i)) - (l_theta(r_i) - l_0(r_i)) ], l the sequence
  log-prob, c_i / r_i the chosen / rejected answers: the DPO implicit reward margin divided by beta;
- `task/dpo_accuracy` = share of pairs with a positive margin.

With `rewards` (the RL arms), for every reward r of `rewards.REWARDS` on the pirate-style prompts:
`task/<r>_reward`, the mean reward of `rl_eval_samples` completions per prompt sampled from the trained model
(`rewards.sampled_rewards`, seed 0, at most `rl_completion_tokens`), and `task/<r>_gain`, that minus the base
model's (drawn the same way once): the RL arm's task progress.
"""

import torch

from hf_cfp.evaluation import (
    BaseResponses,
    answer_log_probs,
    draw_base_responses,
    greedy_exact_match,
    reference_log_likelihood,
    refusal_rate,
)
from hf_cfp.loading.prompts import eval_items, pirate_preference_triples, pirate_style_pairs

from .plan import DOMAINS, RL_REWARDS, Plan, rl_optimizer
from .rewards import sampled_rewards

# what "task progress" means for each optimizer (higher is better)
TASK_PROGRESS = {
    "sft": "task/sft_gain",
    "dpo": "task/dpo_margin",
    **{rl_optimizer(reward): f"task/{reward}_gain" for reward in RL_REWARDS},
}


class CapabilityProbe:
    """Base-model references drawn once (responses and log-probs; no copy of the base weights), then
    `measure(model)` for any trained model."""

    def __init__(self, base_model, tokenizer, plan: Plan):
        self.tokenizer, self.plan = tokenizer, plan
        self.items = {d: eval_items(d) for d in DOMAINS}
        self.base_responses: dict[str, BaseResponses] = {
            d: draw_base_responses(
                base_model,
                tokenizer,
                [p for p, _ in items[: plan.kl_prompts]],
                plan.kl_samples,
                plan.kl_new_tokens,
                seed=0,
                batch_size=8,
            )
            for d, items in self.items.items()
        }
        self.sft_pairs = pirate_style_pairs()
        self.triples = pirate_preference_triples()
        self.base_task = self._task_log_probs(base_model)
        self.rl_prompts = [p for p, _ in self.sft_pairs]
        self.base_rewards = self._rewards(base_model) if plan.rl_rewards else {}

    def _rewards(self, model) -> dict[str, float]:
        plan = self.plan
        return sampled_rewards(model, self.tokenizer, self.rl_prompts, plan.rl_eval_samples, plan.rl_completion_tokens)

    def _task_log_probs(self, model) -> dict[str, torch.Tensor]:
        """Per-token mean log-probs of the SFT targets; sequence log-probs of chosen and rejected answers."""
        tok = self.tokenizer
        sums, lengths = answer_log_probs(model, tok, [p for p, _ in self.sft_pairs], [r for _, r in self.sft_pairs])
        prompts = [p for p, _, _ in self.triples]
        chosen, _ = answer_log_probs(model, tok, prompts, [c for _, c, _ in self.triples])
        rejected, _ = answer_log_probs(model, tok, prompts, [r for _, _, r in self.triples])
        return {"sft": sums / lengths, "chosen": chosen, "rejected": rejected}

    def measure(self, model, greedy: bool, rewards: bool = False) -> dict[str, float]:
        """The module docstring's numbers for `model` (greedy scores only with `greedy`: they cost the most;
        the rewards only with `rewards`)."""
        row: dict[str, float] = {}
        for domain, items in self.items.items():
            estimate = self.base_responses[domain].kl(model)
            prompts, answers = [p for p, _ in items], [a for _, a in items]
            row[f"{domain}/kl"], row[f"{domain}/kl_stderr"] = estimate.kl, estimate.stderr
            row[f"{domain}/log_lik"] = reference_log_likelihood(model, self.tokenizer, prompts, answers)
        if greedy:
            math_prompts, math_answers = zip(*self.items["math"], strict=True)
            row["math/exact_match"] = greedy_exact_match(
                model, self.tokenizer, list(math_prompts), list(math_answers), self.plan.greedy_new_tokens
            )
            safety_prompts = [p for p, _ in self.items["safety"]]
            row["safety/refusal_rate"] = refusal_rate(
                model, self.tokenizer, safety_prompts, max(1, self.plan.greedy_new_tokens // 2)
            )
        task, base = self._task_log_probs(model), self.base_task
        margins = (task["chosen"] - base["chosen"]) - (task["rejected"] - base["rejected"])
        row["task/sft_gain"] = float((task["sft"] - base["sft"]).mean())
        row["task/dpo_margin"] = float(margins.mean())
        row["task/dpo_accuracy"] = float((margins > 0).double().mean())
        if rewards:
            for name, value in self._rewards(model).items():
                row[f"task/{name}_reward"] = value
                row[f"task/{name}_gain"] = value - self.base_rewards[name]
        return row
