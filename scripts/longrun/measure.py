"""What the long run measures on a model, along a run (`point`) and at its end (`final`), each number with its
standard error (a table's 95% interval is 1.96 of it):

- `<d>/kl`, `<d>/kl_stderr` per capability d (math, code, safety): KL(mu_0 || mu_theta) on `kl_prompts` held-out
  prompts (`eval_items(d)`), `kl_samples` base responses each at the end, the first response of each along the
  run (`kl_estimate`'s stderr over prompts); `<d>/kl_items` the responses scored;
- task progress on the held-out prompts (never trained on): `task/sft_gain` = mean over items of the per-token
  log-likelihood gain of the pirate answer, `task/dpo_margin` = mean of (l_theta(c) - l_0(c)) - (l_theta(r) -
  l_0(r)) (pirate answer c, plain r, sequence log-probs), its two parts `task/chosen_gain` = mean l_theta(c) -
  l_0(c) and `task/rejected_gain` = mean l_theta(r) - l_0(r), `task/dpo_accuracy` the share of positive margins,
  each with `_stderr` (sample sd / sqrt(n)) and `task/items`;
- with `Plan.behaviour`, the task judged on behaviour (SFT and DPO along the run, every arm at its end): on the
  held-out prompts, `behaviour_samples` completions at temperature 1 (seeded by the arm's seed) and the greedy
  one, at most `task_new_tokens` tokens each, scored by the pirate-lexicon reward GRPO trains on
  (`evidence.rewards.pirate`); `behaviour/pirate_gain` = mean over prompts of (the prompt's mean reward over its
  completions - the base model's, same prompts, seed and counts), with `_stderr` over prompts, its parts
  `behaviour/pirate_sampled_gain` and `behaviour/pirate_greedy_gain`, `behaviour/pirate_reward` (the model's own
  mean) and `behaviour/items` (prompts);
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
from evidence.rewards import pirate, sampled_completions, sampled_rewards

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
BEHAVIOUR = "behaviour/pirate"  # the behavioural measure's metric prefix (module docstring)
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


@torch.no_grad()
def pirate_scores(model, tokenizer, prompts: list[str], samples: int, new_tokens: int, seed: int) -> torch.Tensor:
    """The pirate reward of each prompt's completions, float64 [prompts, samples + 1]: `samples` sampled at
    temperature 1 (`sampled_completions`, `seed`), then the greedy one, at most `new_tokens` tokens each."""
    sampled = pirate(sampled_completions(model, tokenizer, prompts, samples, new_tokens, seed))
    answers = greedy_answers(model, tokenizer, prompts, new_tokens)
    greedy = [tokenizer.decode(ids, skip_special_tokens=True) for ids in answers]
    scores = torch.tensor(sampled, dtype=torch.float64).reshape(len(prompts), samples)
    return torch.cat([scores, torch.tensor(pirate(greedy), dtype=torch.float64)[:, None]], dim=1)


def behaviour_gains(scores: torch.Tensor, base: torch.Tensor) -> dict[str, float]:
    """The module docstring's `behaviour/` numbers from a model's and the base model's `pirate_scores`."""
    row: dict[str, float] = {f"{BEHAVIOUR}_reward": float(scores.mean()), "behaviour/items": scores.shape[0]}
    parts = {"": slice(None), "_sampled": slice(0, -1), "_greedy": slice(-1, None)}
    for name, columns in parts.items():
        gains = scores[:, columns].mean(1) - base[:, columns].mean(1)
        row[f"{BEHAVIOUR}{name}_gain"], row[f"{BEHAVIOUR}{name}_gain_stderr"] = mean_stderr(gains)
    return row


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
        self.base_model = base_model
        self._base_behaviour: dict[int, torch.Tensor] = {}  # the base's `pirate_scores` by seed, when first asked

    def behaviour(self, model, seed: int) -> dict[str, float]:
        """The `behaviour/` numbers of `model` (module docstring), sampled with `seed` (the base's too)."""
        plan, prompts = self.plan, [item["prompt"] for item in self.heldout]
        args = (self.tokenizer, prompts, plan.behaviour_samples, plan.task_new_tokens, seed)
        if seed not in self._base_behaviour:
            self._base_behaviour[seed] = pirate_scores(self.base_model, *args)
        return behaviour_gains(pirate_scores(model, *args), self._base_behaviour[seed])

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
        for part in ("chosen", "rejected"):
            row[f"task/{part}_gain"], row[f"task/{part}_gain_stderr"] = mean_stderr(task[part] - base[part])
        row["task/dpo_accuracy"], row["task/dpo_accuracy_stderr"] = mean_stderr((margins > 0).double())
        return row

    def _kl(self, model, references: dict[str, BaseResponses]) -> dict[str, float]:
        row: dict[str, float] = {}
        for domain, base in references.items():
            estimate = kl_estimate(base.base_log_probs, base.log_probs(model), base.num_samples_per_prompt)
            row[f"{domain}/kl"], row[f"{domain}/kl_stderr"] = estimate.kl, estimate.stderr
            row[f"{domain}/kl_items"] = len(base.responses)
        return row

    def point(self, model, optimizer: str, seed: int) -> dict[str, float]:
        """The curve's numbers: every capability's KL on the first responses, and task progress (with
        `Plan.behaviour`, on SFT and DPO, its behaviour too)."""
        row = {**self._kl(model, self.curve_references), **self._task(model)}
        if self.plan.behaviour and not grpo_reward(optimizer):
            row |= self.behaviour(model, seed)
        return row

    def final(self, model, optimizer: str, seed: int = 0) -> dict[str, float]:
        """The module docstring's numbers at the end of a run (GRPO arms also their rewards)."""
        row = {**self._kl(model, self.references), **self._task(model)}
        if self.plan.behaviour:
            row |= self.behaviour(model, seed)
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
