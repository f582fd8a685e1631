"""`hf-cfp demo`: estimate a math anchor, fine-tune with and without CFP, compare drift (`demo.run_demo`)."""

from ..demo import run_demo
from .checks import check_output_directory, checked_kfac_rank


def run(args) -> None:
    """Check `--output-dir` and `--kfac-rank`, then run the demo with the given flags (None: the demo's defaults;
    `--kfac-rank` not given: `run_demo`'s rank, `full`: every eigenpair)."""
    check_output_directory(args.output_dir, "--output-dir")
    rank = checked_kfac_rank(args)
    run_demo(
        tiny=args.tiny,
        steps=args.steps,
        num_sequences=args.num_sequences,
        max_new_tokens=args.max_new_tokens,
        lam=args.lam,
        output_dir=args.output_dir,
        peft=args.peft,
        learning_rate=args.learning_rate,
        structure=args.structure,
        **({} if args.kfac_rank is None else {"kfac_rank": rank}),
    )
