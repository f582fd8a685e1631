"""The `hf-cfp` command line: `demo`, `estimate`, `push`, `pull`, `inspect`, `compare`, `diagnose`, `train`."""

import argparse
import json

import torch
from accelerate import PartialState

from .anchor import FisherAnchor
from .anchor.compare import compare_anchors
from .anchor.statistics import concentration
from .demo import run_demo
from .demo.bundled import CALIBRATION_SETS, load_pairs, load_prompts
from .demo.models import load_causal_lm
from .demo.run import sft_examples
from .errors import CFPArgumentError, CFPError
from .fisher import estimate_fisher
from .fisher.diagnostics import diagnose_anchors
from .launch.train import train_main


def _demo(args) -> None:
    run_demo(
        tiny=args.tiny,
        steps=args.steps,
        num_sequences=args.num_sequences,
        max_new_tokens=args.max_new_tokens,
        lam=args.lam,
        output_dir=args.output_dir,
        peft=args.peft,
        learning_rate=args.learning_rate,
    )


def _estimate(args) -> None:
    state = PartialState()  # joins the process group under `accelerate launch` / torchrun
    model, tokenizer = load_causal_lm(args.model)
    model.to(state.device)
    anchor = estimate_fisher(
        model,
        tokenizer,
        load_prompts(args.prompts),
        num_sequences=args.num_sequences,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        seed=args.seed,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        name=args.name,
        estimator=args.estimator,
        engine=args.engine,
        num_samples_per_prompt=args.num_samples_per_prompt,
        scoring_tokens=args.scoring_tokens,
    )
    if state.is_main_process:
        anchor.save_pretrained(args.output)
        stats = anchor.metadata["statistics"]
        print(
            f"Saved {anchor!r} to {args.output}: total mass {stats['total_mass']:.4g}, "
            f"p99 {stats['p99']:.3g}, top 1% holds {stats['top1pct_mass_share']:.1%}"
        )


def _load(args) -> FisherAnchor:
    return FisherAnchor.from_pretrained(args.anchor, revision=args.revision, local_files_only=args.offline)


def _inspect(args) -> None:
    anchor = _load(args)
    print(repr(anchor))
    print(json.dumps({**anchor.metadata, "concentration": concentration(anchor.fisher)}, indent=2, sort_keys=True))


def _compare(args) -> None:
    a, b = (FisherAnchor.from_pretrained(ref, local_files_only=args.offline) for ref in (args.a, args.b))
    result = compare_anchors(a, b)
    width = max([len(row["type"]) for row in result["module_types"]] + [30]) + 2
    print(f"A: {args.a} (anchor {a.name!r})\nB: {args.b} (anchor {b.name!r})")
    print(f"{result['num_parameters']:,} coordinates\n\ntop-set overlap |T(A) & T(B)| / |T|")
    for label, overlap in result["top_overlap"].items():
        print(f"{'  top ' + label:<{width}}{overlap:>18.4f}")
    print(
        f"{'cosine(F_A, F_B)':<{width}}{result['cosine']:>18.6f}\n\n{'module type':<{width}}{'A mass':>9}{'B mass':>9}"
    )
    for row in result["module_types"]:
        print(f"{row['type']:<{width}}{row['share_a']:>9.2%}{row['share_b']:>9.2%}")


def _diagnose(args) -> None:
    anchors = [FisherAnchor.from_pretrained(ref, local_files_only=args.offline) for ref in args.anchor]
    if args.num_examples is not None and args.num_examples < 1:
        raise CFPArgumentError(f"--num-examples must be >= 1, got {args.num_examples}.")
    pairs = load_pairs(args.data)[: args.num_examples]
    model, tokenizer = load_causal_lm(args.model)
    rows = sft_examples(tokenizer, pairs)
    ids, mask, labels = (torch.stack([row[key] for row in rows]) for key in ("input_ids", "attention_mask", "labels"))
    print(f"Model: {args.model}; SFT batch: {args.data}, {len(pairs)} (prompt, response) pairs\n")
    reports = diagnose_anchors(model, anchors, ids, labels, mask, args.batch_size)  # one gradient for all
    for reference, report in zip(args.anchor, reports, strict=True):
        print(f"{reference}\n{report.to_text()}\n")


def _pull(args) -> None:
    anchor = _load(args)
    if args.output:
        anchor.save_pretrained(args.output)
    hub = anchor.metadata.get("hub", {})
    print(
        f"{anchor!r} at commit {hub.get('commit')}"
        + (f", saved to {args.output}" if args.output else " (in the cache)")
    )


def _push(args) -> None:
    anchor = FisherAnchor.from_pretrained(args.anchor)
    info = anchor.push_to_hub(
        args.repo_id,
        path_in_repo=args.path_in_repo,
        revision=args.revision,
        create_pr=args.create_pr,
        private=args.private or None,
    )
    print(
        f"Pushed {anchor!r} to {args.repo_id}: {getattr(info, 'commit_url', info)}"
        + (f" (pull request {info.pr_url})" if getattr(info, "pr_url", None) else "")
    )


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
    demo.add_argument(
        "--peft", action="store_true", help="train LoRA adapters (r=16, attention and MLP projections), base anchor"
    )
    demo.add_argument(
        "--learning-rate", type=float, default=None, help="default 5e-5 (LoRA 1e-3); tiny 3e-3 (LoRA 3e-2)"
    )
    demo.set_defaults(run=_demo)
    estimate = commands.add_parser(
        "estimate", help="estimate a Fisher anchor and save it (accelerate launch for many processes)"
    )
    estimate.add_argument("--model", default="smollm2-135m", help="local model directory, .gguf file, or smollm2-135m")
    sets = ", ".join(CALIBRATION_SETS)
    estimate.add_argument("--prompts", default="math", help=f"bundled set name ({sets}) or a .jsonl/.json/.txt file")
    estimate.add_argument("--output", required=True, help="directory to save the anchor to")
    estimate.add_argument("--name", default="math", help="capability name (metric keys)")
    estimate.add_argument("--num-sequences", type=int, default=128)
    estimate.add_argument("--num-samples-per-prompt", type=int, default=1)
    estimate.add_argument("--max-new-tokens", type=int, default=256)
    estimate.add_argument("--batch-size", type=int, default=8, help="sequences sampled together")
    estimate.add_argument(
        "--scoring-tokens", type=int, default=256, help="padded tokens scored per forward + backward (memory)"
    )
    estimate.add_argument("--seed", type=int, default=0)
    estimate.add_argument("--temperature", type=float, default=1.0)
    estimate.add_argument("--top-k", type=int, default=None)
    estimate.add_argument("--top-p", type=float, default=1.0)
    estimate.add_argument("--estimator", choices=("sequence", "token"), default="sequence")
    estimate.add_argument("--engine", choices=("batched", "loop"), default="batched")
    estimate.set_defaults(run=_estimate)
    push = commands.add_parser("push", help="push a saved anchor to a Hub repo (one commit, with a model card)")
    push.add_argument("anchor", help="anchor directory")
    push.add_argument("repo_id", help="e.g. org/model (the base model's repo, with --create-pr) or org/anchors")
    push.add_argument("--path-in-repo", default=None, help="default cfp/<name>")
    push.add_argument("--revision", default=None)
    push.add_argument("--create-pr", action="store_true")
    push.add_argument("--private", action="store_true")
    push.set_defaults(run=_push)
    for command, helps, run in (
        ("pull", "download an anchor (only its files) at a pinned revision", _pull),
        ("inspect", "print an anchor's metadata, statistics and concentration", _inspect),
    ):
        sub = commands.add_parser(command, help=helps)
        sub.add_argument("anchor", help="anchor directory, or Hub reference org/model[@revision][:subfolder]")
        sub.add_argument("--revision", default=None, help="branch, tag, refs/pr/N or commit sha")
        sub.add_argument("--offline", action="store_true", help="use the local cache only")
        if command == "pull":
            sub.add_argument("--output", default=None, help="also save a copy to this directory")
        sub.set_defaults(run=run)
    compare = commands.add_parser(
        "compare", help="top-set overlap, cosine and mass per module type of two anchors over the same parameters"
    )
    for which in ("a", "b"):
        compare.add_argument(which, help="anchor directory, or Hub reference org/model[@revision][:subfolder]")
    compare.add_argument("--offline", action="store_true", help="use the local cache only")
    compare.set_defaults(run=_compare)
    diagnose_ = commands.add_parser(
        "diagnose", help="where an SFT batch's gradient lies against anchors' top-1%% F, and the Fisher bound on it"
    )
    diagnose_.add_argument("--anchor", nargs="+", required=True, help="anchor directories or Hub references")
    diagnose_.add_argument(
        "--model", default="smollm2-135m", help="the anchors' model: directory, .gguf, smollm2-135m"
    )
    diagnose_.add_argument(
        "--data",
        default="pirate_style",
        help="'pirate_style' (bundled, the demo's SFT set) or a .jsonl of prompt/response (or completion) pairs",
    )
    diagnose_.add_argument("--num-examples", type=int, default=None, help="the first N pairs (default all)")
    diagnose_.add_argument("--batch-size", type=int, default=8, help="rows per forward (memory only)")
    diagnose_.add_argument("--offline", action="store_true", help="use the local cache only")
    diagnose_.set_defaults(run=_diagnose)
    train = commands.add_parser("train", help="train with TRL + CFP from a YAML config: train {sft,dpo,grpo} --config")
    train.add_argument("arguments", nargs=argparse.REMAINDER, help="sft|dpo|grpo, then TRL-style --key value")
    train.set_defaults(run=lambda args: train_main(args.arguments))
    args = parser.parse_args(argv)
    try:
        args.run(args)
    except CFPError as error:  # a bad path, reference or anchor: the message says what to do
        parser.exit(1, f"hf-cfp {args.command}: error: {error}\n")


if __name__ == "__main__":
    main()
