"""Resuming a protected Trainer run: where the checkpoint being resumed keeps its theta0."""

import os

from transformers import TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging

from ..errors import CFPError
from ..parallel import log_on_main_process
from ..protection import SavedTheta0, has_saved_theta0

logger = logging.get_logger(__name__)


def saved_theta0(
    args: TrainingArguments, state: TrainerState, resumed_from: str | None, restart_path_on_resume: bool
) -> SavedTheta0 | None:
    """The theta0 saved in the checkpoint being resumed: the path the Trainer resumes from, else
    `args.resume_from_checkpoint`, else `output_dir/checkpoint-<step>`. Without one, raise
    CFPError, or with `restart_path_on_resume=True` return None (theta0 = the resumed weights)."""
    explicit = getattr(args, "resume_from_checkpoint", None)  # a loop may pass no TrainingArguments
    checkpoint = resumed_from or (explicit if isinstance(explicit, str) else None)
    if checkpoint is None and getattr(args, "output_dir", None):
        checkpoint = checkpoint_dir(args, state)
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
