"""Resuming a protected Trainer run: where the checkpoint being resumed keeps its theta0."""

import os

from transformers import TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging

from ..errors import CFPError
from ..parallel import log_on_main_process
from ..protection import SavedTheta0, has_saved_theta0

logger = logging.get_logger(__name__)


def public_checkpoint(args: TrainingArguments | None, state: TrainerState) -> str | None:
    """The checkpoint a resumed run resumes from, as far as the callback's own arguments tell: the directory
    `args.resume_from_checkpoint` names (set by scripts that pass it on to `train()`, as `hf-cfp train` does), else
    `output_dir/checkpoint-<global_step>` (what `train(resume_from_checkpoint=True)` resumes: the latest checkpoint
    of output_dir, whose step the resumed state carries); None when neither is a directory. A path given to
    `train(resume_from_checkpoint=...)` alone reaches no callback (`reporting.find_trainer_call` reads it)."""
    explicit = getattr(args, "resume_from_checkpoint", None)  # a loop may pass no TrainingArguments
    candidates = [explicit if isinstance(explicit, (str, os.PathLike)) else None]
    if args is not None and getattr(args, "output_dir", None):
        candidates.append(checkpoint_dir(args, state))
    return next((os.fspath(c) for c in candidates if c is not None and os.path.isdir(c)), None)


def saved_theta0(
    args: TrainingArguments | None, state: TrainerState, checkpoint: str | None, restart_path_on_resume: bool
) -> SavedTheta0 | None:
    """The theta0 saved in `checkpoint`, the one being resumed (`public_checkpoint`, else the path the Trainer's
    `train()` was given). Without one, raise CFPError, or with `restart_path_on_resume=True` return None
    (theta0 = the resumed weights)."""
    if checkpoint is not None and has_saved_theta0(checkpoint):
        return SavedTheta0(checkpoint)
    if restart_path_on_resume:
        log_on_main_process(
            logger.info,
            "CFPCallback: no saved theta0 in %s; the protected path restarts at the resumed weights "
            "(restart_path_on_resume=True).",
            checkpoint,
        )
        return None
    raise CFPError(
        f"CFPCallback: resuming at step {state.global_step}, but the checkpoint {checkpoint!r} has no saved "
        "theta0 (cfp_theta0-rank*.safetensors), so the protected path would restart at the resumed weights. "
        "Resume from a checkpoint saved while CFPCallback was attached; if your trainer does not pass the path "
        "it resumes from, set TrainingArguments(resume_from_checkpoint=<that path>); or pass "
        "CFPCallback(..., restart_path_on_resume=True) to start the path again on purpose."
    )


def checkpoint_dir(args: TrainingArguments, state: TrainerState) -> str:
    """Where the Trainer writes (and by default resumes) the checkpoint of the current step."""
    return os.path.join(str(args.output_dir), f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
