"""The long run on the embedded SmolLM2-135M (or a tiny random model): hundreds of steps of SFT and DPO, GRPO,
every protection and the baselines a practitioner would pick instead, each measured along the run.

    python scripts/long_run.py --tiny                 # the whole pipeline in a few minutes
    python scripts/long_run.py --plot                 # the embedded model (docs/reports/evidence.md)
    python scripts/long_run.py --report-only --plot   # tables and plots from the results so far
    python scripts/long_run.py --behaviour --plot     # issue 50: behaviour, a second seed, several capabilities

Results (`results.jsonl`), tables (`long_run.md`) and plots go to --output-dir; an interrupted run resumes where it
stopped. Started more than once on one --output-dir, the processes share the arms (`scripts/longrun/workers.py`;
on 2 cores two workers on one thread each outrun one on two threads: `scripts/bench_workers.py`). What each arm
is: `scripts/longrun/plan.py`; what is measured: `scripts/longrun/measure.py`.
"""

import argparse
import os
from pathlib import Path

import datasets
from evidence.run import read_results
from longrun.plan import EMBEDDED, EMBEDDED_BEHAVIOUR, TINY, TINY_BEHAVIOUR
from longrun.report import markdown_report, plot_report, proxy_view
from longrun.run import run_long

from hf_cfp.loading.models import EMBEDDED as EMBEDDED_MODEL


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a random tiny Llama: checks the pipeline, not the method")
    parser.add_argument(
        "--behaviour",
        action="store_true",
        help="the behavioural plan: the task judged by sampled behaviour, a second seed, several capabilities",
    )
    parser.add_argument(
        "--output-dir", default=None, help="default: long-run-tiny or long-run-smollm2 (--behaviour: behaviour-...)"
    )
    parser.add_argument("--anchors-dir", default=None, help="where anchors are saved (default: <output-dir>/anchors)")
    parser.add_argument("--plot", action="store_true", help="also draw the frontier and curve plots (matplotlib)")
    parser.add_argument("--report-only", action="store_true", help="only write tables (and plots) from the results")
    args = parser.parse_args(argv)
    datasets.disable_progress_bars()
    plans = {
        (False, False): EMBEDDED,
        (True, False): TINY,
        (False, True): EMBEDDED_BEHAVIOUR,
        (True, True): TINY_BEHAVIOUR,
    }
    plan = plans[args.tiny, args.behaviour]
    prefix = "behaviour" if args.behaviour else "long-run"
    out = Path(args.output_dir or f"{prefix}-{'tiny' if args.tiny else 'smollm2'}")
    if args.report_only:
        rows = read_results(out / "results.jsonl")
    else:
        rows = run_long(plan, "tiny" if args.tiny else EMBEDDED_MODEL, str(out), args.anchors_dir)
    report = markdown_report(rows, plan)
    (out / "long_run.md").write_text(report, encoding="utf-8")
    print("\n" + report + f"\nTables: {out / 'long_run.md'}")
    if args.plot:
        views = [(plan, ""), (proxy_view(plan), "_log_likelihood")] if plan.behaviour else [(plan, "")]
        for view, suffix in views:
            for path in plot_report(rows, view, out, suffix):
                print(f"Plot: {path}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
