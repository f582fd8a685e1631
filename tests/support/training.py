"""Tiny `transformers.Trainer` runs on random token rows: CPU, seeded, no saving, no reporting."""

import torch
from transformers import Trainer, TrainingArguments


def lm_dataset(n=16, length=12, vocab=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, vocab, (n, length), generator=g)]


def train(model, callbacks, tmp_path, steps=5, **overrides):
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=steps,
        per_device_train_batch_size=4,
        learning_rate=3e-2,
        use_cpu=True,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        **overrides,
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
