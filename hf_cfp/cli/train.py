"""`hf-cfp train {sft,dpo,grpo} --config cfg.yaml [--key value ...]`: TRL training with CFP (`launch.train`)."""

from ..launch.train import train_main


def run(args) -> None:
    """Hand the arguments after `train` (the trainer kind, then TRL-style options) to TRL's parser and train."""
    train_main(args.arguments)
