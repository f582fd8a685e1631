"""KLToBaseCallback: the capability KL to the base model, logged during training without a second model."""

from typing import Any

from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.utils import logging

from ..errors import CFPArgumentError
from ..evaluation import BaseResponses, draw_base_responses
from ..fisher.token_ids import to_token_ids
from ..parallel import log_on_main_process
from .reporting import add_to_step_log, attach_before_reporters, find_trainer_call, place_at_train_begin

logger = logging.get_logger(__name__)


class KLToBaseCallback(TrainerCallback):
    r"""
    A [`~transformers.TrainerCallback`] that logs how far the trained model's sequence distribution has moved
    from the base model's on a capability's held-out prompts, without keeping the base model in memory.

    At the first train begin it draws m responses per prompt from the model as it is then (the base mu_0, the
    sampler at `temperature`, no truncation; responses end at EOS or after `max_new_tokens`, as in
    [`estimate_fisher`]) and stores their token ids and base log-probs log mu_0(y|x) (a later `train()` keeps
    them). At every logging step it scores the stored responses under the current model (one scoring pass, no
    grad) and adds

    $$\mathrm{KL} = \frac{1}{P}\sum_p \frac{1}{m}\sum_j \big[\log\mu_0(y_{pj}|x_p) - \log\mu_\theta(y_{pj}|x_p)\big]$$

    as `cfp/<name>/kl_to_base` (nats) and its standard error as `cfp/<name>/kl_to_base_stderr` (see
    `hf_cfp.evaluation.kl`). The value equals `kl_to_base(base, model, ...)` with the same arguments. Like
    [`CFPCallback`]'s metrics they reach every logger in `report_to` and `state.log_history`.

    Cost: one sampling pass at train begin, one scoring forward over the P*m responses per logging step.
    Memory: the responses and one float each. On a `peft.PeftModel` the current model is the PeftModel, and the
    base is the PeftModel at train begin (with freshly initialized LoRA, the base model). Every process computes
    the same value (no collective); resuming from a checkpoint draws the base from the resumed weights, so the KL
    is then to the resumed model (a warning says so).

    Args:
        tokenizer: encodes text or chat prompts and supplies EOS / pad ids; `None` for token-id prompts.
        prompts: held-out capability prompts, any form [`estimate_fisher`] takes (keep them disjoint from the
            anchor's calibration prompts).
        name (`str`, *optional*, defaults to `"capability"`): the capability, in the metric keys.
        num_samples_per_prompt, max_new_tokens, temperature, seed, batch_size, eos_token_id: as in
            [`kl_to_base`].

    Raises:
        CFPArgumentError: an empty `name`, no prompts, or text prompts without a tokenizer.

    Example:

    ```python
    from hf_cfp import CFPCallback, KLToBaseCallback

    callbacks = [CFPCallback(anchor, lam=10.0), KLToBaseCallback(tokenizer, heldout_math_prompts, name="math")]
    ```
    """

    def __init__(
        self,
        tokenizer,
        prompts,
        name: str = "capability",
        num_samples_per_prompt: int = 4,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        seed: int = 0,
        batch_size: int = 8,
        eos_token_id: int | list[int] | None = None,
    ):
        if not isinstance(name, str) or not name:
            raise CFPArgumentError(f"name must be a non-empty string (it keys the metrics), got {name!r}.")
        self.tokenizer = tokenizer
        self.prompt_ids = to_token_ids(prompts, tokenizer)  # bad prompts fail here, not at train begin
        self.name = name
        self.draw_kwargs: dict[str, Any] = {
            "num_samples_per_prompt": num_samples_per_prompt,
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "seed": seed,
            "batch_size": batch_size,
            "eos_token_id": eos_token_id,
        }
        self.base: BaseResponses | None = None  # drawn at the first train begin
        self._attached = False

    def attach(self, trainer: Trainer) -> "KLToBaseCallback":
        """Add this callback to `trainer` just before its reporting callbacks (see `CFPCallback.attach`).

        Args:
            trainer (`transformers.Trainer`): the trainer (TRL trainers included) about to train.

        Returns:
            `KLToBaseCallback`: this callback.
        """
        attach_before_reporters(trainer, self)
        self._attached = True
        return self

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.base is None:
            if state.global_step > 0:
                log_on_main_process(
                    logger.warning_once,
                    "KLToBaseCallback[%s]: training resumes at step %d, so the base responses are drawn from the "
                    "resumed weights and kl_to_base is measured from them, not from the original base model.",
                    self.name,
                    state.global_step,
                )
            self.base = draw_base_responses(kwargs["model"], self.tokenizer, self.prompt_ids, **self.draw_kwargs)
        if not self._attached:
            place_at_train_begin(self, find_trainer_call(self))

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        if self.base is not None and logs is not None and "loss" in logs:
            add_to_step_log(state, logs, self.base.kl(kwargs["model"]).metrics(self.name))
