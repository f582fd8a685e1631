"""The multi-process tests' shared setup (tests/integration/test_distributed.py, test_deepspeed.py).

The same tiny Llama, rows, anchors and training runs are used by the worker processes
(tests/workers/*.py, launched with `run_worker`) and by the single-process references computed in
the test process.
"""

import math
import os
from pathlib import Path

import torch
from transformers import Trainer, TrainerControl, TrainerState, TrainingArguments

from hf_cfp import CFPCallback, FisherAnchor
from support.tiny import tiny_llama, torchrun

TESTS = Path(__file__).resolve().parents[1]
WORKERS = TESTS / "workers"

VOCAB, HIDDEN, LENGTH, ROWS, STEPS, LAM, LR = 33, 16, 12, 4, 4, 10.0, 3e-2  # VOCAB 33: uneven shards


def run_worker(script, *args, env=None, **kwargs):
    """`torchrun` of tests/workers/<script> with `tests/` on PYTHONPATH, so that the worker imports
    `support.*` as the tests do; returns the CompletedProcess."""
    pythonpath = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    return torchrun(WORKERS / script, *args, env={"PYTHONPATH": pythonpath, **(env or {})}, **kwargs)


def make_model():
    return tiny_llama(vocab_size=VOCAB, hidden_size=HIDDEN)


def make_rows():
    ids = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def random_fisher(model, seed, keep=lambda name: True):
    """name -> F: a random permutation of distinct values in (0.01, 1.01] over the kept parameters."""
    shapes = {n: p.shape for n, p in model.named_parameters() if keep(n)}
    sizes = [math.prod(s) for s in shapes.values()]
    perm = torch.randperm(sum(sizes), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    flat = 0.01 + (perm + 1) / sum(sizes)
    return {n: t.float().reshape(shapes[n]) for n, t in zip(shapes, flat.split(sizes), strict=True)}


def make_callback(model):
    """Protect with `math` (every parameter) and monitor `code` (the MLPs only)."""
    math_anchor = FisherAnchor(random_fisher(model, seed=1), name="math")
    code_anchor = FisherAnchor(random_fisher(model, seed=2, keep=lambda n: "mlp" in n), name="code")
    return CFPCallback(math_anchor, lam=LAM, monitor=[code_anchor])


def trainer_run(model, callbacks, output_dir, per_device_batch):
    """STEPS steps of transformers.Trainer (AdamW); returns the last log entry with a loss."""
    args = TrainingArguments(
        output_dir=str(output_dir),
        max_steps=STEPS,
        per_device_train_batch_size=per_device_batch,
        learning_rate=LR,
        use_cpu=True,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=make_rows(), callbacks=callbacks)
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h][-1]


def loop_run(model, callback, rows):
    """STEPS AdamW steps on `rows`, calling the callback's hooks like the Trainer; returns its metrics."""
    ids = torch.stack([r["input_ids"] for r in rows])
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    state, control = TrainerState(), TrainerControl()
    if callback is not None:
        callback.on_train_begin(None, state, control, model=model)
    for step in range(1, STEPS + 1):
        model(input_ids=ids, labels=ids).loss.backward()  # FSDP2 averages gradients over processes
        optimizer.step()
        optimizer.zero_grad()
        state.global_step = step
        if callback is not None:
            callback.on_step_end(None, state, control)
    logs = {"loss": 0.0}
    if callback is not None:
        callback.on_log(None, state, control, logs=logs)
    return logs
