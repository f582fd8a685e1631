"""The baselines a practitioner would pick instead of CFP (besides the KL penalty and the isotropic pull, which are
`evidence.controls`'): learning without forgetting, WiSE-FT and LoRA.

- `Distillation` (LwF): the base model's full next-token distributions p0 on the response positions of the math
  anchor's calibration sequences (its prompts, the base model's own responses: `draw_base_responses` with the
  anchor's sampler, batches and seed gives exactly the sequences `estimate_fisher` scored), stored once; a trainer
  made by `with_distillation` adds to its loss

      beta * KLbar,   KLbar = (1/|T_b|) sum_{t in T_b} sum_v p0_v(t) (log p0_v(t) - log p_theta,v(t)),

  T_b the response positions of the next `batch_size` of those sequences (in turn), full vocabulary. The drawn
  sequences are cached at `path` when one is given, so that a resumed run distils on the same ones.
- `wise_ft(base, trained, a)`: theta0 + a (theta_T - theta0), parameter by parameter (no training).
- `lora_model(model, rank)`: PEFT LoRA of rank r, alpha 2r, on the attention and MLP projections.
"""

import copy
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as nnf

from hf_cfp.evaluation import draw_base_responses

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class Distillation:
    """The LwF targets (module docstring): `input_ids` / `attention_mask` (right-padded), the response positions
    of each sequence, and log p0 there (float32, [positions, vocabulary])."""

    def __init__(self, base_model, tokenizer, prompts, sequences: int, new_tokens: int, batch_size: int, path=None):
        if path is not None and Path(path).exists():
            drawn = torch.load(path, weights_only=False)
        else:
            cycled = [prompts[n % len(prompts)] for n in range(sequences)]
            drawn = draw_base_responses(base_model, tokenizer, cycled, 1, new_tokens, seed=0, batch_size=8)
            if path is not None:
                torch.save(drawn, path)
        rows = [p + r for p, r in zip(drawn.prompts, drawn.responses, strict=True)]
        width = max(len(row) for row in rows)
        self.input_ids = torch.tensor([row + [drawn.pad_id] * (width - len(row)) for row in rows])
        self.attention_mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])
        # position t predicts token t + 1: the response tokens of sequence n are predicted at
        # len(prompt) - 1 .. len(prompt) + len(response) - 2
        self.positions = [
            torch.arange(len(p) - 1, len(p) + len(r) - 1) for p, r in zip(drawn.prompts, drawn.responses, strict=True)
        ]
        self.batch_size, self.next = batch_size, 0
        with torch.no_grad():
            self.base_log_probs = [self._log_probs(base_model, n) for n in range(sequences)]

    def _log_probs(self, model, n: int) -> torch.Tensor:
        logits = model(input_ids=self.input_ids[n : n + 1], attention_mask=self.attention_mask[n : n + 1]).logits
        return nnf.log_softmax(logits[0, self.positions[n]].float(), dim=-1)

    def kl(self, model) -> torch.Tensor:
        """KLbar (module docstring) of `model` on the next `batch_size` sequences, with its gradient."""
        count = len(self.positions)
        chosen = [(self.next + k) % count for k in range(self.batch_size)]
        self.next = (self.next + self.batch_size) % count
        device = next(model.parameters()).device
        rows = torch.tensor(chosen)
        logits = model(input_ids=self.input_ids[rows].to(device), attention_mask=self.attention_mask[rows].to(device))
        total, positions = torch.zeros((), device=device), 0
        for k, n in enumerate(chosen):
            log_p = nnf.log_softmax(logits.logits[k, self.positions[n].to(device)].float(), dim=-1)
            log_p0 = self.base_log_probs[n].to(device)
            total = total + (log_p0.exp() * (log_p0 - log_p)).sum()
            positions += len(self.positions[n])
        return total / max(positions, 1)


def with_distillation(trainer_class: type) -> type:
    """A subclass of `trainer_class` (transformers' Trainer or a TRL trainer) whose training loss adds
    `distill_beta * distillation.kl(model)` (`Distillation`), the mean KLbar of each log window logged as
    `lwf_kl`. Constructed with the trainer's arguments plus `distillation=` and `distill_beta=`."""

    class DistillationTrainer(trainer_class):
        def __init__(self, *args: Any, distillation: Distillation, distill_beta: float, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self.distillation, self.distill_beta = distillation, float(distill_beta)
            self._kls: list[float] = []

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if not model.training or self.distill_beta == 0:
                return out
            kl = self.distillation.kl(model)
            self._kls.append(float(kl.detach()))
            if return_outputs:
                return out[0] + self.distill_beta * kl, out[1]
            return out + self.distill_beta * kl

        def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
            if "loss" in logs and self._kls:
                logs["lwf_kl"], self._kls = sum(self._kls) / len(self._kls), []
            super().log(logs, start_time)

    DistillationTrainer.__name__ = f"Distillation{trainer_class.__name__}"
    return DistillationTrainer


@torch.no_grad()
def wise_ft(base_model, trained: dict[str, torch.Tensor], alpha: float):
    """A copy of `base_model` with every parameter in `trained` set to theta0 + alpha (theta_T - theta0)."""
    model = copy.deepcopy(base_model)
    for name, param in model.named_parameters():
        if name in trained:
            param.lerp_(trained[name].to(param.dtype), alpha)
    return model


def lora_model(model, rank: int):
    """`model` wrapped by PEFT LoRA: rank r, alpha 2r, no dropout, on `LORA_TARGETS` (those the model has)."""
    from peft import LoraConfig, get_peft_model

    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    targets = [t for t in LORA_TARGETS if t in names]
    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=targets, task_type="CAUSAL_LM")
    return get_peft_model(model, config)
