"""What the long run measures on a model, along a run (`point`) and at its end (`final`), each number with its
standard error (a table's 95% interval is 1.96 of it):

- `<d>/kl`, `<d>/kl_stderr` per capability d (math, code, safety): KL(mu_0 || mu_theta) on `kl_prompts` held-out
  prompts (`eval_items(d)`), `kl_samples` base responses each at the end, the first response of each along the
  run (`kl_estimate`'s stderr over prompts); `<d>/kl_items` the responses scored;
- task progress on the held-out prompts (never trained on): `task/sft_gain` = mean over items of the per-token
  log-likelihood gain of the pirate answer, `task/dpo_margin` = mean of (l_theta(c) - l_0(c)) - (l_theta(r) -
  l_0(r)) (pirate answer c, plain r, sequence log-probs), `task/dpo_accuracy` the share of positive margins, each
  with `_stderr` (sample sd / sqrt(n)) and `task/items`;
- at the end only: `math/exact_match` on `math_items` generated problems (`data.math_problems`, greedy,
  `math_new_tokens`), its binomial stderr sqrt(p (1 - p) / n) and `math/items`; the code and safety reference
  log-likelihoods and `safety/refusal_rate` of the bundled held-out sets (`evidence`'s measures); for GRPO arms
  `task/<reward>_reward` and `task/<reward>_gain` (minus the base's) of `grpo_eval_samples` completions on
  `grpo_eval_prompts` held-out prompts (`evidence.rewards.sampled_rewards`).

The base model's responses are drawn once and cached in `<output_dir>/references.pt` (drawing them is the slow
part), so a resumed run measures against the same responses.
"""

import math
from dataclasses import replace
from pathlib import Path

import torch
from evidence.rewards import sampled_rewards

from hf_cfp.evaluation import (
    BaseResponses,
    answer_log_probs,
    draw_base_responses,
    greedy_answers,
    greedy_exact_match,
    kl_estimate,
    reference_log_likelihood,
    refusal_rate,
)
from hf_cfp.loading.prompts import eval_items

from .data import math_problems
from .plan import Plan, grpo_reward

DOMAINS = ("math", "code", "safety")
MATH_EXAMPLES = 8  # greedy answers kept per row (`Probe.math_examples`), to read what exact match scored


def mean_stderr(values: torch.Tensor) -> tuple[float, float]:
    """(mean, sample sd / sqrt(n)) of a float tensor (stderr nan for one value)."""
    values = values.double()
    stderr = float(values.std(correction=1)) / math.sqrt(values.numel()) if values.numel() > 1 else float("nan")
    return float(values.mean()), stderr


def first_responses(base: BaseResponses) -> BaseResponses:
    """The first response of every prompt of `base` (m = 1): the cheaper KL measured along a run."""
    m = base.num_samples_per_prompt
    return replace(
        base,
        prompts=base.prompts[::m],
        responses=base.responses[::m],
        base_log_probs=base.base_log_probs[::m].clone(),
        num_samples_per_prompt=1,
    )


def base_references(base_model, tokenizer, plan: Plan, path: Path) -> dict[str, BaseResponses]:
    """{domain: the base model's responses to its first `kl_prompts` held-out prompts}, drawn once (seed 0,
    batches of 8) and cached at `path`."""
    if path.exists():
        return torch.load(path, weights_only=False)
    references = {
        d: draw_base_responses(
            base_model,
            tokenizer,
            [p for p, _ in eval_items(d)[: plan.kl_prompts]],
            plan.kl_samples,
            plan.kl_new_tokens,
            seed=0,
            batch_size=8,
        )
        for d in DOMAINS
    }
    torch.save(references, path)
    return references


class Probe:
    """The base model's references (responses, task log-probs, rewards), then `point(model)` and `final(model)`."""

    def __init__(self, base_model, tokenizer, plan: Plan, heldout: list[dict], references: dict[str, BaseResponses]):
        self.tokenizer, self.plan, self.heldout = tokenizer, plan, heldout
        self.references = references
        self.curve_references = {d: first_responses(r) for d, r in references.items()}
        self.math = math_problems(plan.math_items)
        self.base_task = self._task_log_probs(base_model)
        self.reward_prompts = [item["prompt"] for item in heldout[: plan.grpo_eval_prompts]]
        self.base_rewards = self._rewards(base_model) if plan.grpo_rewards else {}

    def _task_log_probs(self, model) -> dict[str, torch.Tensor]:
        prompts = [item["prompt"] for item in self.heldout]
        tok = self.tokenizer
        pirate, lengths = answer_log_probs(model, tok, prompts, [item["pirate"] for item in self.heldout])
        plain, _ = answer_log_probs(model, tok, prompts, [item["plain"] for item in self.heldout])
        return {"per_token": pirate / lengths, "chosen": pirate, "rejected": plain}

    def _rewards(self, model) -> dict[str, float]:
        plan = self.plan
        return sampled_rewards(
            model, self.tokenizer, self.reward_prompts, plan.grpo_eval_samples, plan.grpo_completion_tokens
        )

    def _task(self, model) -> dict[str, float]:
        task, base = self._task_log_probs(model), self.base_task
        margins = (task["chosen"] - base["chosen"]) - (task["rejected"] - base["rejected"])
        row: dict[str, float] = {"task/items": len(self.heldout)}
        row["task/sft_gain"], row["task/sft_gain_stderr"] = mean_stderr(task["per_token"] - base["per_token"])
        row["task/dpo_margin"], row["task/dpo_margin_stderr"] = mean_stderr(margins)
        row["task/dpo_accuracy"], row["task/dpo_accuracy_stderr"] = mean_stderr((margins > 0).double())
        return row

    def _kl(self, model, references: dict[str, BaseResponses]) -> dict[str, float]:
        row: dict[str, float] = {}
        for domain, base in references.items():
            estimate = kl_estimate(base.base_log_probs, base.log_probs(model), base.num_samples_per_prompt)
            row[f"{domain}/kl"], row[f"{domain}/kl_stderr"] = estimate.kl, estimate.stderr
            row[f"{domain}/kl_items"] = len(base.responses)
        return row

    def point(self, model) -> dict[str, float]:
        """The curve's numbers: every capability's KL on the first responses, and task progress."""
        return {**self._kl(model, self.curve_references), **self._task(model)}

    def final(self, model, optimizer: str) -> dict[str, float]:
        """The module docstring's numbers at the end of a run (GRPO arms also their rewards)."""
        row = {**self._kl(model, self.references), **self._task(model)}
        prompts, answers = zip(*self.math, strict=True)
        accuracy = greedy_exact_match(model, self.tokenizer, list(prompts), list(answers), self.plan.math_new_tokens)
        row["math/exact_match"], row["math/items"] = accuracy, len(self.math)
        row["math/exact_match_stderr"] = math.sqrt(accuracy * (1 - accuracy) / len(self.math))
        for domain in ("code", "safety"):
            items = eval_items(domain)
            questions, references = [q for q, _ in items], [a for _, a in items]
            row[f"{domain}/log_lik"] = reference_log_likelihood(model, self.tokenizer, questions, references)
        safety = [p for p, _ in eval_items("safety")]
        row["safety/refusal_rate"] = refusal_rate(model, self.tokenizer, safety, self.plan.math_new_tokens * 2)
        row["safety/items"] = len(safety)
        if grpo_reward(optimizer):
            for name, value in self._rewards(model).items():
                row[f"task/{name}_reward"], row[f"task/{name}_gain"] = value, value - self.base_rewards[name]
        return row

    def math_examples(self, model) -> list[dict[str, str]]:
        """The greedy answers (decoded, `math_new_tokens`) to the first `MATH_EXAMPLES` math problems, each with
        its problem and the reference answer: what `math/exact_match` scored, to read."""
        problems = self.math[:MATH_EXAMPLES]
        prompts = [prompt for prompt, _ in problems]
        responses = greedy_answers(model, self.tokenizer, prompts, self.plan.math_new_tokens)
        return [
            {"prompt": prompt, "answer": str(answer), "response": self.tokenizer.decode(ids, skip_special_tokens=True)}
            for (prompt, answer), ids in zip(problems, responses, strict=True)
        ]
