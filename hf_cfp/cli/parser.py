"""The `hf-cfp` argument parser: every command, its options and their types, and nothing that loads torch.

Each command names its handler as "module:function" inside `hf_cfp.cli` (`handler` default) and the optional
packages it cannot run without (`needs`, default none); `main` checks those, then imports that module, only when
the command runs, so `hf-cfp --help` stays fast. Argument errors print two lines
(what is wrong, where to read the options) and exit with `EXIT_USAGE`.
"""

import argparse

from ..geometry import STRUCTURES  # the registry (no torch)
from ..loading.prompts import CALIBRATION_SETS
from .failures import EXIT_USAGE

ANCHOR_REFERENCE = "anchor directory, or Hub reference org/model[@revision][:subfolder]"
FULL_RANK = "full"  # --kfac-rank full: every eigenpair (estimate_fisher's kfac_rank=None)
DTYPES = ("float32", "bfloat16", "float16", "auto")  # loading.models.DTYPES (not imported: it imports torch)
MODEL = "local model directory, .gguf file, smollm2-135m (the embedded model), or Hub id org/name[@revision]"


class CommandParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are two lines and exit code `EXIT_USAGE` (2), not the usage block."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\nRun `{self.prog} --help` for the options.\n")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _int_at_least(text, 0)


def _int_at_least(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {least}, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be an integer >= {least}, got {value}")
    return value


def kfac_rank(text: str) -> int | str:
    """argparse type: an integer >= 1, or `FULL_RANK` ("full": every eigenpair of each factor)."""
    if text == FULL_RANK:
        return FULL_RANK
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError as error:
        raise argparse.ArgumentTypeError(f"{error} (or {FULL_RANK!r}: every eigenpair)") from None


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    return _number(text, lambda value: value > 0, "> 0")


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    return _number(text, lambda value: value >= 0, ">= 0")


def _number(text: str, accept, condition: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number {condition}, got {text!r}") from None
    if not accept(value) or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number {condition}, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The `hf-cfp` parser: `demo`, `estimate`, `push`, `pull`, `inspect`, `compare`, `diagnose`, `train`;
    `--debug` is accepted before or after the command (for `train`, before its trainer kind)."""
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument(
        "--debug",
        action="store_true",
        default=argparse.SUPPRESS,  # so that a command's parser does not reset a `hf-cfp --debug <command>`
        help="on an error, show the full traceback (also: environment HF_CFP_DEBUG=1)",
    )
    parser = CommandParser(
        prog="hf-cfp",
        description="Cumulative Fisher Protection for HF Trainer / TRL.",
        epilog="Exit codes: 0 success, 1 failure, 2 bad arguments or missing input.",
        parents=[debug],
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")
    _add_demo(commands, debug)
    _add_estimate(commands, debug)
    _add_anchor_commands(commands, debug)
    _add_diagnose(commands, debug)
    _add_train(commands, debug)
    return parser


def _add_demo(commands, debug) -> None:
    demo = commands.add_parser(
        "demo", parents=[debug], help="estimate a math anchor, fine-tune with and without CFP, compare drift"
    )
    demo.add_argument("--tiny", action="store_true", help="a random tiny Llama instead of SmolLM2-135M (seconds)")
    demo.add_argument("--steps", type=positive_int, default=None, help="optimizer steps per arm (default 20; tiny 30)")
    demo.add_argument(
        "--num-sequences", type=positive_int, default=None, help="calibration sequences (default 16; tiny 64)"
    )
    demo.add_argument("--max-new-tokens", type=positive_int, default=48)
    _add_structure_arguments(
        demo,
        structure="kfac",
        rank_default="256: what the evidence recommends",
        structure_help="the math anchor's geometry: kfac (Kronecker factors A (x) G of each Linear weight, diagonal "
        "F elsewhere; the default), or diagonal F (cheaper, weaker)",
    )
    demo.add_argument(
        "--lam", type=non_negative_float, default=None, help="CFP strength (default 1 / p99 of the anchor's F)"
    )
    demo.add_argument("--output-dir", default="cfp-demo")
    demo.add_argument(
        "--peft", action="store_true", help="train LoRA adapters (r=16, attention and MLP projections), base anchor"
    )
    demo.add_argument(
        "--learning-rate", type=positive_float, default=None, help="default 5e-5 (LoRA 1e-3); tiny 3e-3 (LoRA 3e-2)"
    )
    demo.set_defaults(handler="demo:run")


def _add_estimate(commands, debug) -> None:
    estimate = commands.add_parser(
        "estimate", parents=[debug], help="estimate a Fisher anchor and save it (accelerate launch for many processes)"
    )
    _add_model_arguments(estimate)
    sets = ", ".join(CALIBRATION_SETS)
    estimate.add_argument("--prompts", default="math", help=f"bundled set name ({sets}) or a .jsonl/.json/.txt file")
    estimate.add_argument("--output", required=True, help="directory to save the anchor to")
    estimate.add_argument("--name", default="math", help="capability name (metric keys)")
    estimate.add_argument("--num-sequences", type=positive_int, default=128)
    estimate.add_argument("--num-samples-per-prompt", type=positive_int, default=1)
    estimate.add_argument("--max-new-tokens", type=positive_int, default=256)
    estimate.add_argument("--batch-size", type=positive_int, default=8, help="sequences sampled together")
    estimate.add_argument(
        "--scoring-tokens", type=positive_int, default=256, help="padded tokens scored per forward + backward (memory)"
    )
    estimate.add_argument("--seed", type=non_negative_int, default=0)
    estimate.add_argument("--temperature", type=float, default=1.0, help="> 0 (default 1.0)")
    estimate.add_argument("--top-k", type=int, default=None, help=">= 1 (default: no top-k truncation)")
    estimate.add_argument("--top-p", type=float, default=1.0, help="in (0, 1] (default 1.0: no truncation)")
    estimate.add_argument("--estimator", choices=("sequence", "token"), default="sequence")
    estimate.add_argument("--engine", choices=("batched", "loop"), default="batched")
    _add_structure_arguments(
        estimate,
        structure="diagonal",
        rank_default="full",
        structure_help="kfac: Kronecker factors A (x) G for each Linear weight (the interactions inside a layer), "
        "diagonal F elsewhere",
    )
    estimate.set_defaults(handler="estimate:run")


def _add_structure_arguments(
    command: argparse.ArgumentParser, structure: str, rank_default: str, structure_help: str
) -> None:
    """`--structure` (default `structure`) and `--kfac-rank` (estimate, demo). `--kfac-rank` is None when not given
    (the command's own default, `rank_default` in its help), else an integer >= 1 or `FULL_RANK`."""
    command.add_argument("--structure", choices=tuple(STRUCTURES), default=structure, help=structure_help)
    command.add_argument(
        "--kfac-rank",
        type=kfac_rank,
        default=None,
        metavar="{R,full}",
        help="with --structure kfac: the eigenpairs kept per factor, the rest of each factor at their mean (its "
        f"tail); full: all of them (default {rank_default})",
    )


def _add_model_arguments(command: argparse.ArgumentParser) -> None:
    """`--model`, `--dtype` and `--device` (estimate, diagnose)."""
    command.add_argument("--model", default="smollm2-135m", help=MODEL)
    command.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="the model's parameters (default: bfloat16 on a GPU, float32 on a CPU; auto: the checkpoint's own)",
    )
    command.add_argument(
        "--device",
        default=None,
        help="cpu, cuda, cuda:N (default: cuda if torch sees one, else cpu; under accelerate launch, each process's "
        "own GPU)",
    )


def _add_anchor_commands(commands, debug) -> None:
    push = commands.add_parser(
        "push", parents=[debug], help="push a saved anchor to a Hub repo (one commit, with a model card)"
    )
    push.add_argument("anchor", help="anchor directory")
    push.add_argument("repo_id", help="e.g. org/model (the base model's repo, with --create-pr) or org/anchors")
    push.add_argument("--path-in-repo", default=None, help="default cfp/<name>")
    push.add_argument("--revision", default=None)
    push.add_argument("--create-pr", action="store_true")
    push.add_argument("--private", action="store_true")
    push.set_defaults(handler="anchors:push")
    for command, helps in (
        ("pull", "download an anchor (only its files) at a pinned revision"),
        ("inspect", "summarize an anchor: base model, estimator, sampler, statistics, mass per module type"),
    ):
        sub = commands.add_parser(command, parents=[debug], help=helps)
        sub.add_argument("anchor", help=ANCHOR_REFERENCE)
        sub.add_argument("--revision", default=None, help="branch, tag, refs/pr/N or commit sha")
        sub.add_argument("--offline", action="store_true", help="use the local cache only")
        if command == "pull":
            sub.add_argument("--output", default=None, help="also save a copy to this directory")
        else:
            sub.add_argument(
                "--full",
                action="store_true",
                help="print all the metadata as JSON (fingerprint included) and the top-set shares, "
                "reading every tensor",
            )
        sub.set_defaults(handler="anchors:pull" if command == "pull" else "inspect:run")
    compare = commands.add_parser(
        "compare",
        parents=[debug],
        help="top-set overlap, cosine and mass per module type of two anchors over the same parameters",
    )
    for which in ("a", "b"):
        compare.add_argument(which, help=ANCHOR_REFERENCE)
    compare.add_argument("--offline", action="store_true", help="use the local cache only")
    compare.set_defaults(handler="anchors:compare")


def _add_diagnose(commands, debug) -> None:
    diagnose = commands.add_parser(
        "diagnose",
        parents=[debug],
        help="where an SFT batch's gradient lies against anchors' top-1%% F, and the Fisher bound on it",
    )
    diagnose.add_argument("--anchor", nargs="+", required=True, help="anchor directories or Hub references")
    _add_model_arguments(diagnose)
    diagnose.add_argument(
        "--data",
        default="pirate_style",
        help="'pirate_style' (bundled, the demo's SFT set) or a .jsonl of prompt/response (or completion) pairs",
    )
    diagnose.add_argument("--num-examples", type=positive_int, default=None, help="the first N pairs (default all)")
    diagnose.add_argument("--batch-size", type=positive_int, default=8, help="rows per forward (memory only)")
    diagnose.add_argument("--offline", action="store_true", help="use the local cache only (anchors and model)")
    diagnose.set_defaults(handler="diagnose:run")


def _add_train(commands, debug) -> None:
    train = commands.add_parser(
        "train",
        parents=[debug],
        help="train with TRL and CFP from a YAML config: train {sft,dpo,grpo} --config cfg.yaml [--key value ...]",
        description="Everything after the trainer kind is read by TRL's parser (`hf-cfp train sft --help` lists "
        "every key): YAML values replace the defaults, flags replace both.",
    )
    train.add_argument(
        "arguments", nargs=argparse.REMAINDER, help="sft, dpo or grpo, then --config cfg.yaml and --key value"
    )
    train.set_defaults(handler="train:run", needs=("trl", "datasets"))  # the `trl` extra
