"""The `hf-cfp` command line: `demo`, `estimate`, `inspect`."""

import argparse
import json

from .anchor import FisherAnchor


def _demo(args) -> None:
    from .demo import run_demo

    run_demo(tiny=args.tiny, steps=args.steps, num_sequences=args.num_sequences,
             max_new_tokens=args.max_new_tokens, lam=args.lam, output_dir=args.output_dir)


def _estimate(args) -> None:
    from accelerate import PartialState

    from .data import load_prompts
    from .fisher import estimate_fisher
    from .models import load_causal_lm

    state = PartialState()  # joins the process group under `accelerate launch` / torchrun
    model, tokenizer = load_causal_lm(args.model)
    model.to(state.device)
    anchor = estimate_fisher(
        model, tokenizer, load_prompts(args.prompts), num_sequences=args.num_sequences,
        max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, seed=args.seed,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, name=args.name,
        estimator=args.estimator, engine=args.engine, num_samples_per_prompt=args.num_samples_per_prompt,
    )
    if state.is_main_process:
        anchor.save_pretrained(args.output)
        stats = anchor.metadata["statistics"]
        print(f"Saved {anchor!r} to {args.output}: total mass {stats['total_mass']:.4g}, "
              f"p99 {stats['p99']:.3g}, top 1% holds {stats['top1pct_mass_share']:.1%}")


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
    estimate = commands.add_parser("estimate", help="estimate a Fisher anchor and save it (accelerate launch for many processes)")
    estimate.add_argument("--model", default="smollm2-135m", help="local model directory, .gguf file, or smollm2-135m")
    estimate.add_argument("--prompts", default="math", help="bundled set name (math) or a .jsonl/.json/.txt file")
    estimate.add_argument("--output", required=True, help="directory to save the anchor to")
    estimate.add_argument("--name", default="math", help="capability name (metric keys)")
    estimate.add_argument("--num-sequences", type=int, default=128)
    estimate.add_argument("--num-samples-per-prompt", type=int, default=1)
    estimate.add_argument("--max-new-tokens", type=int, default=256)
    estimate.add_argument("--batch-size", type=int, default=8)
    estimate.add_argument("--seed", type=int, default=0)
    estimate.add_argument("--temperature", type=float, default=1.0)
    estimate.add_argument("--top-k", type=int, default=None)
    estimate.add_argument("--top-p", type=float, default=1.0)
    estimate.add_argument("--estimator", choices=("sequence", "token"), default="sequence")
    estimate.add_argument("--engine", choices=("batched", "loop"), default="batched")
    estimate.set_defaults(run=_estimate)
    inspect = commands.add_parser("inspect", help="print an anchor's metadata and statistics")
    inspect.add_argument("anchor", help="anchor directory")
    inspect.set_defaults(run=_inspect)
    args = parser.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
