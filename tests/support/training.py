"""Tiny `transformers.Trainer` runs on random token rows: CPU, seeded, no saving, no reporting."""

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments


def lm_dataset(n=16, length=12, vocab=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, vocab, (n, length), generator=g)]


# Every test run: CPU, no reporters, a log line per step, no checkpoints, seed 0, no progress bar.
QUIET_CPU_RUN = dict(use_cpu=True, report_to="none", logging_steps=1, save_strategy="no", seed=0, disable_tqdm=True)


def train(model, callbacks, tmp_path, steps=5, **overrides):
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=steps,
        per_device_train_batch_size=4,
        learning_rate=3e-2,
        **{**QUIET_CPU_RUN, **overrides},
    )
    Trainer(model=model, args=args, train_dataset=lm_dataset(), callbacks=callbacks).train()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def short_run(model, output_dir, callbacks=(), steps=4, **overrides):
    """A Trainer run on 2 * `steps` random token rows (batch 2, AdamW lr 1e-2, logging every 2 steps, so the
    last step logs); returns the Trainer."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for ids in torch.randint(0, 32, (2 * steps, 12), generator=g):
        rows.append({"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)})
    settings = dict(
        output_dir=str(output_dir),
        use_cpu=True,
        report_to=[],
        logging_steps=2,
        max_steps=steps,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(
        model=model, args=TrainingArguments(**{**settings, **overrides}), train_dataset=rows, callbacks=list(callbacks)
    )
    trainer.train()
    return trainer


def last_cfp_logs(trainer):
    """The cfp/* metrics of the last logging step, which must be the last step."""
    logged = [h for h in trainer.state.log_history if "loss" in h][-1]
    assert logged["step"] == trainer.state.max_steps
    return {k: v for k, v in logged.items() if k.startswith("cfp/")}


def full_batch_rows(n=4, length=12, vocab=32, seed=0):
    """`n` random token rows (labels = input ids) for `full_batch_trainer_args` and `adamw_loop`."""
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": ids, "labels": ids.clone()} for ids in torch.randint(0, vocab, (n, length), generator=g)]


def full_batch_trainer_args(output_dir, rows, steps, lr=1e-2, **overrides):
    """TrainingArguments whose run `adamw_loop` repeats by hand: every step one batch of all `rows` in order,
    torch AdamW (no weight decay) at a constant `lr`, no gradient clipping; logging every step."""
    settings = dict(
        output_dir=str(output_dir),
        max_steps=steps,
        per_device_train_batch_size=len(rows),
        train_sampling_strategy="sequential",
        optim="adamw_torch",
        learning_rate=lr,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,
        **QUIET_CPU_RUN,
    )
    return TrainingArguments(**{**settings, **overrides})


def adamw_loop(model, rows, steps, lr=1e-2, after_step=lambda: None, lr_at=None):
    """The Trainer run of `full_batch_trainer_args`, by hand: `steps` times the mean token cross-entropy of all
    `rows`, backward, torch.optim.AdamW(lr, weight_decay=0).step(), then `after_step()` (a correction rule).
    `lr_at(t)` sets the learning rate of step t (0-based) instead of the constant `lr`."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    batch = {key: torch.stack([row[key] for row in rows]) for key in rows[0]}
    model.train()
    for t in range(steps):
        if lr_at is not None:
            optimizer.param_groups[0]["lr"] = lr_at(t)
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        after_step()


class CrashAfterSave(TrainerCallback):
    """Stops a run with an exception right after the checkpoint of optimizer step `step` is saved."""

    def __init__(self, step):
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise KeyboardInterrupt("simulated crash")


def checkpointed_run(model, output_dir, callbacks, resume=None, **overrides):
    """6 steps of `model` on `lm_dataset()` (batch 4, lr 3e-2, a log line per step, seed 0) with a checkpoint every 2
    steps, resumed from `resume` (as `Trainer.train(resume_from_checkpoint=...)` takes it); returns (the final
    parameters, the log history)."""
    settings = dict(
        output_dir=str(output_dir),
        max_steps=6,
        save_steps=2,
        per_device_train_batch_size=4,
        learning_rate=3e-2,
        use_cpu=True,
        report_to="none",
        logging_steps=1,
        seed=0,
        disable_tqdm=True,
    )
    args = TrainingArguments(**{**settings, **overrides})
    trainer = Trainer(model=model, args=args, train_dataset=lm_dataset(), callbacks=list(callbacks))
    trainer.train(resume_from_checkpoint=resume)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, trainer.state.log_history
