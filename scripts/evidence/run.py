"""Run the evidence experiment: anchors, base references, then every arm of the plan, one result per line.

Results go to `<output_dir>/results.jsonl` as they finish (one JSON object per arm, plus one for the base
model), so an interrupted run keeps what it measured and `resume=True` skips arms already there. Anchors are
saved under `<output_dir>/anchors/` and reused on the next run with the same output directory; only those the
arms still to run need are estimated (`anchors.AnchorStore`), before the first of them, so that each row's
`seconds` are the arm's own (training and measuring).
"""

import json
import time
from dataclasses import asdict
from pathlib import Path

from tqdm.auto import tqdm

from hf_cfp.loading.models import load_causal_lm, tiny_llama, tiny_tokenizer
from hf_cfp.loading.prompts import calibration_prompts, eval_items, pirate_preference_triples, pirate_style_pairs

from .anchors import AnchorStore
from .measure import CapabilityProbe
from .plan import DOMAINS, Plan, rl_reward
from .training import train_arm


def tiny_model_and_tokenizer():
    """A random tiny Llama (hidden 32, 2 layers) and a 512-token BPE trained on every bundled text, so the
    pipeline runs on the same data as the embedded model in seconds. Its numbers mean nothing about math."""
    corpus = [p for d in DOMAINS for p in calibration_prompts(d)]
    corpus += [f"{p} {a}" for d in DOMAINS for p, a in eval_items(d)]
    corpus += [f"{p} {r}" for p, r in pirate_style_pairs()] + [r for _, _, r in pirate_preference_triples()]
    tokenizer = tiny_tokenizer(vocab_size=512, corpus=corpus)
    model = tiny_llama(
        vocab_size=len(tokenizer),
        hidden_size=32,
        heads=4,
        eos_token_id=tokenizer.eos_token_id,
        max_position_embeddings=1024,
    )
    return model, tokenizer


def read_results(path: Path) -> list[dict]:
    """The result rows of `results.jsonl`, in the order they were written (none if the file is missing)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def done_rows(path: Path) -> dict[str, dict]:
    """key -> row of the rows already in `path` (what a resumed run skips)."""
    return {row["key"]: row for row in read_results(path)}


def run_experiment(plan: Plan, model_name: str, output_dir: str, resume: bool = True) -> list[dict]:
    """Every arm of `plan` on `model_name` ("tiny" or a model `load_causal_lm` takes); returns the result rows
    (those already in `results.jsonl` with `resume`)."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.jsonl"
    done = done_rows(results_path) if resume else {}
    if not resume:
        results_path.unlink(missing_ok=True)
    arms = plan.arms()
    todo = [arm for arm in arms if arm.key not in done]
    base_model, tokenizer = tiny_model_and_tokenizer() if model_name == "tiny" else load_causal_lm(model_name)
    store = AnchorStore(base_model, tokenizer, plan, out / "anchors")
    store.prepare({name for arm in todo for name in plan.anchors_of(arm)})
    print("Drawing the base model's held-out responses (once)", flush=True)
    probe = CapabilityProbe(base_model, tokenizer, plan)
    if "base" not in done:
        done["base"] = {"key": "base", "metrics": probe.measure(base_model, greedy=True)}
        append_row(results_path, done["base"])
    bar = tqdm(todo, desc="arms", unit="arm")
    for arm in bar:
        bar.set_postfix_str(arm.key)
        anchors = store.for_arm(plan.anchors_of(arm))
        start = time.perf_counter()
        model, drift = train_arm(arm, base_model, tokenizer, anchors, plan, out / "runs")
        rewards = rl_reward(arm.optimizer) is not None
        metrics = {**drift, **probe.measure(model, greedy=plan.measures_greedy(arm), rewards=rewards)}
        row = {"key": arm.key, "arm": asdict(arm), "metrics": metrics, "seconds": time.perf_counter() - start}
        done[arm.key] = row
        append_row(results_path, row)
        tqdm.write(f"{arm.key}: math kl {metrics['math/kl']:.4g}, {time.perf_counter() - start:.0f} s")
    return [done[key] for key in ["base", *(arm.key for arm in arms)]]


def append_row(path: Path, row: dict) -> None:
    """Add one result row to the JSON-lines file `path`."""
    with path.open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(row) + "\n")
