"""The README's "Choosing lam" table: SFT on the embedded SmolLM2-135M under CFPCallback(math, predicted_kl_budget=B).

    python scripts/budget_table.py                  # the embedded model, anchors shared with reproduce_table.py
    python scripts/budget_table.py --tiny           # the pipeline on a tiny random model, in seconds

For each budget B: the predicted KL 0.5 Delta^T F Delta at the last step, the measured KL to the base on the
anchor's calibration prompts and on held-out math prompts, the task's gain; then how the predicted KL compared
with the measured one across the evidence experiment's arms (scripts/results/evidence-smollm2). Writes
`budget.md` and `results.jsonl` to --output-dir (resumable); with --scaling also `scaling.json`, the measured /
predicted KL along the unregularized run's displacement scaled down. What is measured:
scripts/evidence/budget_table.py.
"""

import argparse
import json
import os
from pathlib import Path

import datasets
from evidence.budget_table import budget_markdown, prediction_summary, run_budget_table, scaling_markdown
from evidence.plan import EMBEDDED as EMBEDDED_PLAN
from evidence.plan import TINY
from evidence.run import read_results

from hf_cfp.loading.models import EMBEDDED

EVIDENCE = Path(__file__).parent / "results" / "evidence-smollm2" / "results.jsonl"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a random tiny Llama: checks the pipeline")
    parser.add_argument("--budgets", type=float, nargs="+", default=None, help="nats (default: 0.005 0.001 0.0002)")
    parser.add_argument("--output-dir", default=None, help="default: budget-tiny or budget-smollm2")
    parser.add_argument(
        "--anchor-dir", default=None, help="default: evidence-tiny/anchors or evidence-smollm2/anchors"
    )
    parser.add_argument(
        "--scaling", action="store_true", help="also the measured / predicted KL along the unregularized displacement"
    )
    args = parser.parse_args(argv)
    datasets.disable_progress_bars()
    plan = TINY if args.tiny else EMBEDDED_PLAN
    name = "tiny" if args.tiny else "smollm2"
    budgets = tuple(args.budgets or ((0.01, 0.002) if args.tiny else (0.005, 0.001, 0.0002)))
    out = Path(args.output_dir or f"budget-{name}")
    rows, scaling = run_budget_table(
        plan,
        "tiny" if args.tiny else EMBEDDED,
        budgets,
        str(out),
        args.anchor_dir or f"evidence-{name}/anchors",
        scaling=args.scaling,
    )
    report = budget_markdown(rows)
    report += "\nPredicted vs measured KL, budget runs: " + prediction_summary(rows)
    if EVIDENCE.exists() and not args.tiny:
        report += "Predicted vs measured KL, evidence arms: " + prediction_summary(read_results(EVIDENCE)[1:])
    if scaling:
        (out / "scaling.json").write_text(json.dumps(scaling, indent=1), encoding="utf-8")
        report += "\nAlong the unregularized displacement, theta0 + s Delta:\n\n" + scaling_markdown(scaling)
    (out / "budget.md").write_text(report, encoding="utf-8")
    print("\n" + report + f"\nTable: {out / 'budget.md'}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
