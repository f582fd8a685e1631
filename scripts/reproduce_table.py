"""Reproduce the structure of the paper's table on the embedded SmolLM2-135M (or a tiny random model).

    python scripts/reproduce_table.py --tiny              # the whole pipeline in a few minutes
    python scripts/reproduce_table.py --plot              # the embedded model (docs/reports/evidence.md)
    python scripts/reproduce_table.py --list              # what is left to run there, and about how long

Rows are methods (unregularized, KL control, CFP with the math / code / safety anchors, diagonal and
Kronecker-factored (CFP-KFAC), step-only, isotropic), columns are domains; each arm is trained with SFT and with DPO
(TRL) from the same weights, and the RL arms with TRL's RLOO on two programmatic rewards (pirate, brevity); every
arm is measured on held-out capability prompts (kl_to_base, scores) and on its task. Then the rank and tail sweep
of CFP-KFAC [math] (ranks with the zero and the mean tail, trace shares; `evidence/plan.py`). Results, tables
(`evidence.md`) and the frontier plot (`frontier.png`) go to --output-dir; an interrupted run resumes, and a run
in a directory holding the committed `scripts/results/evidence-smollm2/results.jsonl` computes only the arms
added since. What each arm is and how it is measured: `scripts/evidence/` (plan.py, training.py, measure.py).
"""

import argparse
import os
from pathlib import Path

import datasets
from evidence.plan import EMBEDDED as EMBEDDED_PLAN
from evidence.plan import TINY
from evidence.report import markdown_report, plot_frontiers
from evidence.run import done_rows, read_results, run_experiment
from evidence.schedule import EMBEDDED_COSTS, TINY_COSTS, remaining

from hf_cfp.loading.models import EMBEDDED


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a random tiny Llama: checks the pipeline, not the method")
    parser.add_argument("--output-dir", default=None, help="default: evidence-tiny or evidence-smollm2")
    parser.add_argument("--plot", action="store_true", help="also draw frontier.png (needs matplotlib)")
    parser.add_argument("--fresh", action="store_true", help="ignore results of an earlier run in --output-dir")
    parser.add_argument(
        "--report-only", action="store_true", help="only write the tables (and plot) from the results so far"
    )
    parser.add_argument(
        "--list", action="store_true", help="print the arms and anchors still to make, with a time estimate, and stop"
    )
    args = parser.parse_args(argv)
    datasets.disable_progress_bars()  # TRL maps the 16 preference pairs once per arm
    plan = TINY if args.tiny else EMBEDDED_PLAN
    out = Path(args.output_dir or ("evidence-tiny" if args.tiny else "evidence-smollm2"))
    if args.list:
        done = {} if args.fresh else done_rows(out / "results.jsonl")
        print(remaining(plan, out, done, TINY_COSTS if args.tiny else EMBEDDED_COSTS))
        return
    if args.report_only:
        rows = read_results(out / "results.jsonl")
    else:
        rows = run_experiment(plan, "tiny" if args.tiny else EMBEDDED, str(out), resume=not args.fresh)
    report = markdown_report(rows, plan)
    (out / "evidence.md").write_text(report, encoding="utf-8")
    print("\n" + report + f"\nTables: {out / 'evidence.md'}")
    if args.plot:
        plot_frontiers(rows, plan, out / "frontier.png")
        print(f"Plot: {out / 'frontier.png'}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
