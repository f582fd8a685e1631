"""The `hf-cfp` command line: `hf-cfp demo [--tiny]`, `hf-cfp inspect DIR`."""

import argparse
import json

from .anchor import FisherAnchor


def _demo(args) -> None:
    from .demo import run_demo

    run_demo(tiny=args.tiny, steps=args.steps, num_sequences=args.num_sequences,
             max_new_tokens=args.max_new_tokens, lam=args.lam, output_dir=args.output_dir)


def _inspect(args) -> None:
    anchor = FisherAnchor.from_pretrained(args.anchor)
    print(repr(anchor))
    print(json.dumps(anchor.metadata, indent=2, sort_keys=True))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="hf-cfp", description="Cumulative Fisher Protection for HF Trainer / TRL.")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="estimate a math anchor, fine-tune with and without CFP, compare drift")
    demo.add_argument("--tiny", action="store_true", help="a random tiny Llama instead of SmolLM2-135M (seconds)")
    demo.add_argument("--steps", type=int, default=None, help="optimizer steps per arm (default 20; tiny 30)")
    demo.add_argument("--num-sequences", type=int, default=None, help="calibration sequences (default 16; tiny 64)")
    demo.add_argument("--max-new-tokens", type=int, default=48)
    demo.add_argument("--lam", type=float, default=None, help="CFP strength (default 1 / p99 of the anchor's F)")
    demo.add_argument("--output-dir", default="cfp-demo")
    demo.set_defaults(run=_demo)
    inspect = commands.add_parser("inspect", help="print an anchor's metadata and statistics")
    inspect.add_argument("anchor", help="anchor directory")
    inspect.set_defaults(run=_inspect)
    args = parser.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
