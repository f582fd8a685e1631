"""What the demo's drift numbers mean for the capability: math measured on held-out prompts, not by the anchor.

For the base model and each trained arm, on the bundled held-out math set (`math_eval.jsonl`, disjoint from
the calibration prompts):

- `kl_to_base` (nats, +- its standard error): the sequence-level KL(mu_0 || mu_theta) on the first
  `KL_PROMPTS` problems, `KL_SAMPLES` base responses each of at most `KL_MAX_NEW_TOKENS` tokens, drawn once
  from the base (seed 0) and scored under every model (`draw_base_responses(...).kl(model)`); 0 for the base;
- `answer log-lik`: `reference_log_likelihood` of the reference answers (nats per token; higher is better);
- `exact match`: `greedy_exact_match` of greedy answers of at most `EM_MAX_NEW_TOKENS` tokens.

The tiny demo (a random model over token ids, no tokenizer) uses random token-id prompts and answers
instead: its numbers exercise the pipeline and mean nothing about math.
"""

import torch
from tqdm.auto import tqdm

from ..evaluation import draw_base_responses, greedy_exact_match, reference_log_likelihood
from ..loading.prompts import math_eval_items

# 64 greedy tokens: SmolLM2-135M explains before it answers; with 16 even the base scored 0 of 24 (cut off)
KL_PROMPTS, KL_SAMPLES, KL_MAX_NEW_TOKENS, EM_MAX_NEW_TOKENS = 8, 2, 32, 64


def held_out_math(tiny: bool) -> tuple[list, list]:
    """(prompts, answers) of the held-out set: the bundled math problems, or for the tiny demo 8 random
    token-id prompts of tokens < 32 (the tiny "capability") with 3-token answers, drawn apart from its
    calibration prompts (a different generator seed)."""
    if not tiny:
        items = math_eval_items()
        return [prompt for prompt, _ in items], [answer for _, answer in items]
    g = torch.Generator().manual_seed(2)
    prompts = [row.tolist() for row in torch.randint(0, 32, (8, 6), generator=g)]
    return prompts, [row.tolist() for row in torch.randint(0, 32, (8, 3), generator=g)]


def report_capability(base_model, models: dict, tokenizer, tiny: bool, seed: int = 0) -> dict[str, dict]:
    """Measure and print the capability lines for the base and each model of `models` ({arm: model});
    returns {"base" | arm: {"kl", "kl_stderr", "log_likelihood", "exact_match"}}."""
    prompts, answers = held_out_math(tiny)
    base = draw_base_responses(
        base_model, tokenizer, prompts[:KL_PROMPTS], KL_SAMPLES, KL_MAX_NEW_TOKENS, seed=seed, batch_size=8
    )
    rows = {}
    measured = {"base": base_model, **models}
    for arm, model in tqdm(measured.items(), total=len(measured), desc="capability", unit="model"):
        estimate = base.kl(model)
        rows[arm] = {
            "kl": estimate.kl,
            "kl_stderr": estimate.stderr,
            "log_likelihood": reference_log_likelihood(model, tokenizer, prompts, answers),
            "exact_match": greedy_exact_match(model, tokenizer, prompts, answers, max_new_tokens=EM_MAX_NEW_TOKENS),
        }
    what = "random token-id stand-ins (tiny model)" if tiny else "held-out math problems, disjoint from calibration"
    print(
        f"\nCapability on {len(prompts)} {what}: kl_to_base on {KL_PROMPTS} prompts x {KL_SAMPLES} base samples"
        f"\n{'model':>6} | {'kl_to_base':>10} {'stderr':>8} | {'answer log-lik':>14} | {'exact match':>11}"
    )
    for arm, row in rows.items():
        print(
            f"{arm:>6} | {row['kl']:>10.5g} {row['kl_stderr']:>8.3g} | {row['log_likelihood']:>14.4f} "
            f"| {row['exact_match']:>11.1%}"
        )
    return rows
