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
