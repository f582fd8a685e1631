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

import pytest
import torch
from transformers import Trainer, TrainerControl, TrainerState, TrainingArguments

from hf_cfp import CFPCallback, FisherAnchor
from hf_cfp.protection import CFPState, SavedTheta0, save_theta0
from support.tiny import accelerate_launch, tiny_llama, torchrun

TESTS = Path(__file__).resolve().parents[1]
WORKERS = TESTS / "workers"
SCRIPTS = TESTS.parent / "scripts"  # `benchkit` (per_rank_loading_worker.py), as pytest's `pythonpath` has it

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
KFAC_LAM = 300.0  # the K-FAC anchor's eigenvalue products are small: this pulls the run visibly


def run_worker(script, *args, env=None, **kwargs):
    """`torchrun` of tests/workers/<script> with `tests/` and `scripts/` on PYTHONPATH, so that the worker imports
    `support.*` and `benchkit.*` as the tests do; returns the CompletedProcess."""
    return torchrun(WORKERS / script, *args, env=_worker_env(env), **kwargs)


def run_deepspeed_worker(script, out, *args):
    """`run_worker` of a DeepSpeed worker on the CPU into `out` (skipped, saying why, when deepspeed cannot be
    imported: imported here, not at collection, as it takes seconds); asserts it succeeded."""
    pytest.importorskip(
        "deepspeed",
        reason="DeepSpeed is not installed or fails to import (pip install deepspeed)",
        exc_type=ImportError,
    )
    run = run_worker(
        script,
        out,
        *args,
        timeout=900,  # the first run builds DeepSpeed's CPU communication extension
        env={"DS_ACCELERATOR": "cpu", "ACCELERATE_USE_DEEPSPEED": "true"},
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]


def launch_worker(script, *args, config_file, launch_args=(), env=None):
    """tests/workers/<script> through the real `accelerate launch --config_file <config_file>` on the CPU
    (`support.tiny.accelerate_launch`), with `tests/` and `scripts/` on PYTHONPATH; returns the CompletedProcess."""
    return accelerate_launch(
        WORKERS / script, *args, config_file=config_file, launch_args=launch_args, env=_worker_env(env)
    )


def _worker_env(env):
    """`env` plus `tests/` and `scripts/` in front of PYTHONPATH, so that a worker imports `support.*` and
    `benchkit.*` as the tests do."""
    pythonpath = os.pathsep.join(filter(None, [str(TESTS), str(SCRIPTS), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": pythonpath, **(env or {})}


def make_model():
    return tiny_llama(vocab_size=VOCAB, hidden_size=HIDDEN)


def per_rank_model():
    """The model of the per-rank loading test: a Llama of 13.6 M parameters (54 MB of float32 F), big enough
    that a process's resident memory shows whether it held the whole anchor; vocabulary 8191: uneven shards."""
    return tiny_llama(vocab_size=8191, hidden_size=512)


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


# kl_budget measured every step on token-id prompts (lam = LAM is the controller's start)
KL_BUDGET = {"kl_budget": 1e-3, "kl_prompts": [[1, 2, 3], [4, 5, 6, 7]], "kl_every": 1}


def make_callback(model, **kwargs):
    """Protect with `math` (every parameter) and monitor `code` (the MLPs only); `kwargs` go to CFPCallback."""
    math_anchor = FisherAnchor(random_fisher(model, seed=1), name="math")
    code_anchor = FisherAnchor(random_fisher(model, seed=2, keep=lambda n: "mlp" in n), name="code")
    return CFPCallback(math_anchor, lam=LAM, monitor=[code_anchor], **kwargs)


SAFETY_PROMPTS = [[20, 21, 22], [23, 24, 25, 26], [27, 28]]


def estimate_kfac_anchor(model, rank=None, name="math", prompts=((1, 2, 3, 4), (5, 6, 7), (8, 9, 10, 11, 12))):
    """A K-FAC anchor of `model` (seeded: the same on any number of processes), named `name` (`math`; `safety` on
    `SAFETY_PROMPTS`); `rank`: the top eigenpairs kept per factor, with the mean of the rest as its tail."""
    from hf_cfp import estimate_fisher

    prompts = [list(p) for p in prompts]
    return estimate_fisher(
        model,
        None,
        prompts,
        num_sequences=8,
        max_new_tokens=6,
        batch_size=2,
        seed=0,
        structure="kfac",
        kfac_rank=rank,
        show_progress=False,
        name=name,
    )


def make_kfac_callback(anchor, **kwargs):
    """Protect with the K-FAC anchor `math` (a directory or an anchor; a list of them: several protecting anchors,
    summed) at a strength that moves the run, and monitor `code` (a diagonal anchor of the MLPs); `kwargs` go to
    CFPCallback."""
    code_anchor = FisherAnchor(random_fisher(make_model(), seed=2, keep=lambda n: "mlp" in n), name="code")
    lam = [KFAC_LAM] * len(anchor) if isinstance(anchor, list) else KFAC_LAM
    return CFPCallback(anchor, lam=lam, monitor=[code_anchor], **kwargs)


def make_lora_model():
    """make_model() wrapped by PEFT: LoRA r=4 on q_proj and v_proj, the lm_head trained through modules_to_save."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])
    return get_peft_model(make_model(), config)


def make_lora_callback(**kwargs):
    """make_callback's anchors for a LoRA model: keyed by the base model's names, `math` corrects the LoRA
    factors of q_proj / v_proj and the lm_head copy, `code` monitors the MLPs (frozen: never moves)."""
    return make_callback(make_model(), **kwargs)


def trainable(model):
    """name -> a copy of every trainable parameter (a LoRA model's factors and modules_to_save copy)."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


LORA_KEYS = (*KEYS, "cfp/math/adapter_residual")
LORA_SCALE = 2.0  # PEFT's default lora_alpha 8 over r 4


def lora_reference_metrics(params):
    """The drift metrics of a LoRA model's trainable `params` against the base weights, in float64: Delta_W =
    s B A on q_proj / v_proj (B0 = 0 at PEFT's init), the lm_head copy minus the initial lm_head; `code` covers
    only frozen MLPs (0)."""
    fisher, initial = random_fisher(make_model(), seed=1), initial_params()
    lm_head = params["base_model.model.lm_head.modules_to_save.default.weight"]
    deltas = {"lm_head.weight": lm_head.double() - initial["lm_head.weight"].double()}
    for layer in range(2):
        for proj in "qv":
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}_proj"
            b, a = (params[f"{prefix}.lora_{f}.default.weight"].double() for f in "BA")
            deltas[f"model.layers.{layer}.self_attn.{proj}_proj.weight"] = LORA_SCALE * b @ a
    delta = torch.cat([d.reshape(-1) for d in deltas.values()])
    f = torch.cat([fisher[n].double().reshape(-1) for n in deltas])
    free = torch.argsort(f)[: math.ceil(0.99 * f.numel())]  # F values are distinct
    return {
        "cfp/math/sensitive_drift": float((f * delta**2).sum().sqrt()),
        "cfp/math/free_drift": float(delta[free].norm()),
        "cfp/code/sensitive_drift": 0.0,
        "cfp/code/free_drift": 0.0,
        "cfp/total_drift": float(delta.norm()),
    }


def check_lora_equals_one_process(per_rank_params, per_rank_logs, output_dir):
    """The LoRA factors and lm_head copy trained by 2 processes (lam > 0) equal each other bitwise and a
    one-process Trainer run of the same global batch within 1e-5, while the callback's effect is > 1000x
    larger; the logged metrics are the same on both processes and equal the one-process ones and a float64
    reference of the merged weights (rel 1e-5), the adapter residual included."""
    model = make_lora_model()
    single_logs = trainer_run(model, [make_lora_callback()], Path(output_dir, "one"), per_device_batch=ROWS)
    single = trainable(model)
    plain = make_lora_model()
    trainer_run(plain, [], Path(output_dir, "plain"), per_device_batch=ROWS)
    two, logs = per_rank_params[0], per_rank_logs[0]
    assert two.keys() == single.keys() and len(single) == 9  # 4 x (A, B) and the lm_head copy
    assert all(torch.equal(two[n], per_rank_params[1][n]) for n in two)  # the same correction everywhere
    diff = max((two[n] - single[n]).abs().max().item() for n in two)
    effect = max((single[n] - p).abs().max().item() for n, p in trainable(plain).items())
    assert diff <= 1e-5 and effect > 1000 * max(diff, 1e-7), (diff, effect)
    reference = lora_reference_metrics(two)
    for key in LORA_KEYS:
        assert logs[key] == per_rank_logs[1][key], key
        assert logs[key] == pytest.approx(single_logs[key], rel=1e-5), key
        if key in reference:
            assert logs[key] == pytest.approx(reference[key], rel=1e-5, abs=1e-12), key
    assert 0 < logs["cfp/math/adapter_residual"] < 1 and reference["cfp/math/sensitive_drift"] > 0


def check_ddp_equals_one_process(per_rank_params, per_rank_logs, output_dir):
    """The parameters trained by 2 DDP processes (lam > 0) equal each other bitwise and a one-process Trainer run
    of the same global batch within 1e-5, while the callback's effect is > 1000x larger; the logged metrics are
    the same on both processes and equal the one-process ones (rel 1e-5). Returns (difference, effect).

    Why 1e-5: both runs see the same 4 rows and the same initial weights; only the float32 summation order of
    the gradient differs (two means of 2 rows averaged by the all-reduce, against one mean of 4 rows), about
    1e-7 relative, and the CFP correction is a deterministic function of the replicated weights. AdamW's
    normalized steps (lr 3e-2) carry that into the weights over STEPS steps at ~1e-7..1e-6, far below 1e-5
    (measured: 0 under accelerate launch, against an effect of 0.077).
    """
    model = make_model()
    single_logs = trainer_run(model, [make_callback(model)], Path(output_dir, "one"), per_device_batch=ROWS)
    plain = make_model()
    trainer_run(plain, [], Path(output_dir, "plain"), per_device_batch=ROWS)
    single, two = trainable(model), per_rank_params[0]
    assert two.keys() == single.keys()
    assert all(torch.equal(two[n], per_rank_params[1][n]) for n in two)  # the same correction everywhere
    diff = max((two[n] - single[n]).abs().max().item() for n in two)
    effect = max((single[n] - p).abs().max().item() for n, p in trainable(plain).items())
    assert diff <= 1e-5 and effect > 1000 * max(diff, 1e-7), (diff, effect)
    for key in KEYS:
        assert per_rank_logs[0][key] == per_rank_logs[1][key], key
        assert per_rank_logs[0][key] == pytest.approx(single_logs[key], rel=1e-5), key
    return diff, effect


def make_state(model, theta0=None):
    """A CFPState with make_callback's anchors on `model`; `theta0` restores a saved one (`SavedTheta0`)."""
    callback = make_callback(make_model())
    return CFPState(model, callback.anchor, callback.monitors, theta0=theta0)


def held_theta0(state):
    """[(name, start, stop, theta0 piece)] of a CFPState: what this process restored or snapshotted,
    with the elements [start, stop) of the flattened full parameter it stands for."""
    return [(t.name, t.held.start, t.held.stop, t.theta0.detach().reshape(-1).clone()) for t in state.tensors]


def fsdp1_full_params(model):
    """An FSDP1 model's full parameters by canonical name, gathered on every rank."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    from hf_cfp.names import canonical_name

    with FullyShardedDataParallel.summon_full_params(model):
        return {canonical_name(n): p.detach().clone() for n, p in model.named_parameters()}


def zero3_full_params(model):
    """A DeepSpeed model's full parameters by name, gathered on every rank (ZeRO-3 partitions included)."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


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


def check_restores_initial_in_one_process(directory):
    """theta0 saved in `directory` by several processes, read in this one (`restored_in_one_process`): the initial
    full weights, exactly."""
    state = restored_in_one_process(directory)
    initial = initial_params()
    assert state.names == list(initial)
    assert all(torch.equal(t0, initial[n]) for n, t0 in zip(state.names, state.theta0, strict=True))


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
