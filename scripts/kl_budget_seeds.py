"""How often does `kl_budget` hold its bounds, over seeds? The tiny hold test of `tests/unit/integrations/
test_kl_budget.py` (120 AdamW steps at lr 1e-2 on 8 random rows, a 0.5-nat budget measured every 2 steps, the tiny
model's own Fisher on 4 prompts as the anchor, diagonal or K-FAC at rank 4 with tails) repeated on `--seeds` random
tiny models (`tiny_llama(seed=s)`), for both rules.

    python scripts/kl_budget_seeds.py                # 20 seeds, both anchors, both rules (about 2 minutes)
    python scripts/kl_budget_seeds.py --seeds 5 --output-dir /tmp/seeds

A run meets the bounds when no measurement exceeds 1.25 B and every one from the first above 0.75 B is within 25% of
B (the issue's criterion). Writes `seeds.jsonl` (one line per run: every measured KL / B) and `seeds.md` (per
anchor and rule: runs meeting the bounds, the measurements in the band, the largest KL's min, median and max, and the
measurements out of the band soon after the first arrival and later).
"""

import argparse
import copy
import json
import os
import statistics
from pathlib import Path

import torch
from tqdm import tqdm

from hf_cfp import CFP, estimate_fisher
from hf_cfp.evaluation import draw_base_responses
from hf_cfp.integrations.kl_control import RULES
from hf_cfp.loading.models import tiny_llama

PROMPTS = [[1, 5, 7], [2, 9], [3, 4, 11, 12], [6, 8]]  # token ids, as the test's
ANCHORS = {"diagonal": dict(structure="diagonal"), "kfac": dict(structure="kfac", kfac_rank=4)}
BUDGET, STEPS, EVERY, LR = 0.5, 120, 2, 1e-2
SETTLING = 8  # the table counts the band's misses within this many measurements of the first arrival apart


def held_kls(seed: int, anchor_kind: str, rule: str) -> list[float]:
    """Every measured KL / B of the tiny hold run on `tiny_llama(seed=seed)` (the rows and prompts fixed)."""
    base = tiny_llama(seed=seed)
    rows = torch.randint(0, 32, (8, 12), generator=torch.Generator().manual_seed(0))
    anchor = estimate_fisher(
        base,
        None,
        PROMPTS,
        num_sequences=32,
        max_new_tokens=16,
        name="math",
        show_progress=False,
        **ANCHORS[anchor_kind],
    )
    responses = draw_base_responses(base, None, PROMPTS, num_samples_per_prompt=8, max_new_tokens=16)
    model = copy.deepcopy(base).train()
    protector = CFP(model, anchor, lam=1.0, kl_budget=BUDGET, kl_prompts=responses, kl_every=EVERY, kl_control=rule)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    held = []
    for _ in range(STEPS):
        model(input_ids=rows, labels=rows).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        protector.step()
        if protector.control.due(protector.steps):
            held.append(protector.measured[0].kl / BUDGET)
    return held


def verdict(held: list[float]) -> dict:
    """Whether `held` (KL / B) meets the bounds; the largest; the measurements in the band from the first above
    0.75 and how many; where after that first one the band was left (0 = the first)."""
    first = next((i for i, kl in enumerate(held) if kl > 0.75), len(held))
    after = held[first:]
    inside = [0.75 <= kl <= 1.25 for kl in after]
    return {
        "met": max(held) <= 1.25 and all(inside),
        "largest": max(held),
        "inside": sum(inside),
        "after": len(after),
        "left_at": [i for i, ok in enumerate(inside) if not ok],
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| anchor | rule | runs meeting the bounds | measurements in the band | largest KL / B: min, median, max "
        f"| out of the band: within {SETTLING} measurements of the first arrival, later |",
        "|---|---|---|---|---|---|",
    ]
    for kind in ANCHORS:
        for rule in RULES:
            runs = [r for r in rows if r["anchor"] == kind and r["rule"] == rule]
            largest = sorted(r["largest"] for r in runs)
            left = [i for r in runs for i in r["left_at"]]
            early = sum(i < SETTLING for i in left)
            lines.append(
                f"| {kind} | {rule} | {sum(r['met'] for r in runs)} of {len(runs)} "
                f"| {sum(r['inside'] for r in runs)} of {sum(r['after'] for r in runs)} "
                f"| {largest[0]:.2f}, {statistics.median(largest):.2f}, {largest[-1]:.2f} "
                f"| {early}, {len(left) - early} |"
            )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=20, help="tiny models 0 .. seeds - 1")
    parser.add_argument("--output-dir", default="kl-budget-tiny-seeds")
    args = parser.parse_args(argv)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    runs = [(seed, kind, rule) for seed in range(args.seeds) for kind in ANCHORS for rule in RULES]
    rows = []
    for seed, kind, rule in tqdm(runs, desc="runs", unit="run"):
        held = held_kls(seed, kind, rule)
        rows.append({"seed": seed, "anchor": kind, "rule": rule, **verdict(held), "held": held})
    (out / "seeds.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    report = table(rows)
    (out / "seeds.md").write_text(report + "\n", encoding="utf-8")
    print(report)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
