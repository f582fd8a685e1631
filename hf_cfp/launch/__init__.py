"""Config-driven training: `CFPConfig` (the `cfp_*` keys of a YAML file or command line) and the launcher behind
`hf-cfp train {sft,dpo,grpo} --config cfg.yaml` (`hf_cfp.launch.train.train_main`)."""

from .config import CFPConfig

__all__ = ["CFPConfig"]
