"""The multi-process tests' shared setup (tests/integration/test_distributed.py, test_deepspeed.py).

The same tiny Llama, rows, anchors and training runs are used by the worker processes
(tests/workers/*.py, launched with `run_worker`) and by the single-process references computed in
the test process. Resumed runs stop after RESUME_STEP of the STEPS steps: `Resume` for the plain
loop, a real Trainer checkpoint (`trainer_run(save_steps=..., resume=...)`) for the Trainer.
"""

import math
import os
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import Trainer, TrainerControl, TrainerState, TrainingArguments

from hf_cfp import CFPCallback, FisherAnchor
from hf_cfp.protection import CFPState, SavedTheta0, save_theta0
from support.tiny import tiny_llama, torchrun

TESTS = Path(__file__).resolve().parents[1]
WORKERS = TESTS / "workers"

VOCAB, HIDDEN, LENGTH, ROWS, STEPS, LAM, LR = 33, 16, 12, 4, 4, 10.0, 3e-2  # VOCAB 33: uneven shards
# The metrics every multi-process test compares (the `math` anchor protects, `code` monitors).
KEYS = (
    "cfp/math/sensitive_drift",
    "cfp/math/free_drift",
    "cfp/code/sensitive_drift",
    "cfp/code/free_drift",
    "cfp/total_drift",
)
RESUME_STEP = 2  # interrupted runs save theta0 after this step and resume there


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


def make_callback(model, **kwargs):
    """Protect with `math` (every parameter) and monitor `code` (the MLPs only); `kwargs` go to CFPCallback."""
    math_anchor = FisherAnchor(random_fisher(model, seed=1), name="math")
    code_anchor = FisherAnchor(random_fisher(model, seed=2, keep=lambda n: "mlp" in n), name="code")
    return CFPCallback(math_anchor, lam=LAM, monitor=[code_anchor], **kwargs)


def make_state(model, theta0=None):
    """A CFPState with make_callback's anchors on `model`; `theta0` restores a saved one (`SavedTheta0`)."""
    callback = make_callback(make_model())
    return CFPState(model, callback.anchor, callback.monitors, theta0=theta0)


def held_theta0(state):
    """[(name, start, stop, theta0 piece)] of a CFPState: what this process restored or snapshotted,
    with the elements [start, stop) of the flattened full parameter it stands for."""
    return [
        (name, held.start, held.stop, t0.detach().reshape(-1).clone())
        for name, held, t0 in zip(state.names, state.held, state.theta0, strict=True)
    ]


def initial_params():
    """name -> the initial weights of the tiny model (theta0 of every run)."""
    return {n: p.detach().clone() for n, p in make_model().named_parameters()}


def check_pieces_equal_initial(per_rank_pieces, whole=False):
    """Every (name, start, stop, theta0 piece) of every rank equals elements [start, stop) of the
    initial weights exactly, and the ranks' pieces of a parameter add up to it (each process holds
    all of it when `whole`, else its disjoint part). Returns how many pieces are proper parts."""
    initial = initial_params()
    covered = dict.fromkeys(initial, 0)
    parts = 0
    for pieces in per_rank_pieces:
        assert [name for name, *_ in pieces] == list(initial)
        for name, start, stop, theta0 in pieces:
            full = initial[name].reshape(-1)
            assert torch.equal(theta0, full[start:stop]), (name, start, stop)
            covered[name] += stop - start
            parts += stop - start < full.numel()
    for name, p in initial.items():
        assert covered[name] == p.numel() * (len(per_rank_pieces) if whole else 1), (name, covered[name])
    return parts


def restored_in_one_process(directory):
    """A CFPState restoring theta0 from `directory` in this process, on a plain model whose weights
    moved (+1 everywhere), so that a snapshot of them could not pass for the restored theta0."""
    model = make_model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    return make_state(model, theta0=SavedTheta0(directory))


def save_one_process_theta0(directory):
    """theta0 of the unsharded model saved by this (single) process, as a checkpoint of a 1-process run."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    save_theta0(make_state(make_model()), directory)
    return Path(directory)


def trainer_run(model, callbacks, output_dir, per_device_batch, save_steps=None, resume=None):
    """STEPS steps of transformers.Trainer (AdamW); returns the last log entry with a loss.

    `save_steps`: save a checkpoint every that many steps; `resume`: the checkpoint to resume from."""
    args = TrainingArguments(
        output_dir=str(output_dir),
        max_steps=STEPS,
        per_device_train_batch_size=per_device_batch,
        learning_rate=LR,
        use_cpu=True,
        report_to="none",
        logging_steps=1,
        **({"save_strategy": "steps", "save_steps": save_steps} if save_steps else {"save_strategy": "no"}),
        seed=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=make_rows(), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=resume)
    return [h for h in trainer.state.log_history if "loss" in h][-1]


@dataclass
class Resume:
    """Cut a `loop_run` after `step` steps and go on with a new `callback` resumed from `checkpoint`.

    The running callback saves theta0 into `checkpoint` (every process, as at a Trainer save; not
    when `save` is False: the checkpoint holds theta0 saved elsewhere, or none), then `callback`
    binds at train begin with `state.global_step = step` and `args.resume_from_checkpoint =
    checkpoint`, on the same model and optimizer, and takes the remaining steps."""

    step: int
    checkpoint: Path
    callback: CFPCallback
    save: bool = True


def loop_run(model, callback, rows, resume=None):
    """STEPS AdamW steps on `rows`, calling the callback's hooks like the Trainer; returns its metrics
    (those of `resume.callback` when the run is cut and resumed, see `Resume`)."""
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
        if resume is not None and step == resume.step:
            callback = resumed(resume, callback, model, optimizer, state, control)
    logs = {"loss": 0.0}
    if callback is not None:
        callback.on_log(None, state, control, logs=logs)
    return logs


def resumed(resume, callback, model, optimizer, state, control):
    """`resume.callback`, bound as at the train begin of a run resumed from `resume.checkpoint`."""
    import torch.distributed as dist

    Path(resume.checkpoint).mkdir(parents=True, exist_ok=True)
    if resume.save:
        save_theta0(callback.protection, resume.checkpoint)
    if dist.is_initialized():
        dist.barrier()  # every process's file is written before any is read
    args = SimpleNamespace(
        output_dir=str(Path(resume.checkpoint).parent), resume_from_checkpoint=str(resume.checkpoint), deepspeed=None
    )
    resume.callback.on_train_begin(args, state, control, model=model, optimizer=optimizer)
    return resume.callback
