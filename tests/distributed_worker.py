"""One process of `tests/test_distributed.py`, launched by `torchrun --nproc_per_node 2` (gloo, CPU).

It trains the same tiny Llama with CFPCallback twice, each run splitting one global batch of
ROWS sequences evenly over the processes:

- DDP: `transformers.Trainer` with `use_cpu=True` (accelerate wraps the model in DDP);
- FSDP2: `fully_shard` per decoder layer and at the root, parameters are DTensors sharded on
  dim 0, driven by a plain loop that calls the callback's hooks as the Trainer does;
- FSDP1: `FullyShardedDataParallel(use_orig_params=True)` per decoder layer and at the root
  (parameters are 1-D views of this process's piece of a FlatParameter, some empty), same loop.
  On CPU it needs `device_id=torch.device("cpu")` and `sync_module_states=False`.

Each process saves what it saw to `<out>/rank<r>.pt`. The single-process references use the
same helpers (`trainer_run`, `loop_run`) in the test process.
"""

import math
import sys

import torch
from support.tiny import tiny_llama
from transformers import Trainer, TrainerControl, TrainerState, TrainingArguments

from hf_cfp import CFPCallback, FisherAnchor

VOCAB, HIDDEN, LENGTH, ROWS, STEPS, LAM, LR = 33, 16, 12, 4, 4, 10.0, 3e-2  # VOCAB 33: uneven shards


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
    return {n: t.float().reshape(shapes[n]) for n, t in zip(shapes, flat.split(sizes))}


def make_callback(model):
    """Protect with `math` (every parameter) and monitor `code` (the MLPs only)."""
    math_anchor = FisherAnchor(random_fisher(model, seed=1), name="math")
    code_anchor = FisherAnchor(random_fisher(model, seed=2, keep=lambda n: "mlp" in n), name="code")
    return CFPCallback(math_anchor, lam=LAM, monitor=[code_anchor])


def trainer_run(model, callbacks, output_dir, per_device_batch):
    """STEPS steps of transformers.Trainer (AdamW); returns the last log entry with a loss."""
    args = TrainingArguments(
        output_dir=str(output_dir), max_steps=STEPS, per_device_train_batch_size=per_device_batch,
        learning_rate=LR, use_cpu=True, report_to="none", logging_steps=1, save_strategy="no", seed=0,
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


def main(out):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from hf_cfp.parallel import local_tensor

    # DDP through the Trainer (it initializes the gloo process group).
    model = make_model()
    ddp_logs = trainer_run(model, [make_callback(model)], f"{out}/ddp", per_device_batch=ROWS // 2)
    rank, world = dist.get_rank(), dist.get_world_size()
    ddp_params = {n: p.detach().clone() for n, p in model.named_parameters()}

    # FSDP2: shard every decoder layer and the root; this process trains on its share of the rows.
    model = make_model()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    callback = make_callback(model)
    fsdp_logs = loop_run(model, callback, make_rows()[rank::world])
    cfp = callback.protection
    owned = {  # what this process keeps per parameter: (local numel, F numel, F bytes held, theta0 numel)
        n: (local_tensor(p).numel(), f.numel(), f.untyped_storage().nbytes(), t0.numel())
        for n, p, f, t0 in zip(callback.anchor.fisher, cfp.params, cfp.views["math"][1], cfp.theta0)
    }
    results = {
        "ddp_logs": ddp_logs, "ddp_params": ddp_params,
        "fsdp2_logs": fsdp_logs, "fsdp2_params": {n: p.full_tensor().detach() for n, p in model.named_parameters()},
        "fsdp2_all_dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
        "fsdp2_all_sharded": all(cfp.sharded), "fsdp2_owned": owned,
    }
    results.update(fsdp1_case(rank, world))
    torch.save(results, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def fsdp1_wrap(use_orig_params):
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return FullyShardedDataParallel(
        make_model(), auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}), device_id=torch.device("cpu"),
        sync_module_states=False, use_orig_params=use_orig_params)


def fsdp1_case(rank, world):
    """FSDP1 trained with the callback, with use_orig_params=True and with flat parameters (False)."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp._flat_param import FlatParameter

    from hf_cfp.anchor.fingerprint import check_fingerprint, model_fingerprint
    from hf_cfp.names import canonical_name

    model = fsdp1_wrap(use_orig_params=True)
    units = [m for m in model.modules() if isinstance(m, FullyShardedDataParallel) and m._handle is not None]
    active = len(units) == 3 and all(isinstance(m._handle.flat_param, FlatParameter) for m in units) and all(
        p.dim() == 1 for p in model.parameters())
    empty = [canonical_name(n) for n, p in model.named_parameters() if p.numel() == 0]
    check_fingerprint(model_fingerprint(make_model()), model, "math")  # full shapes seen through the pieces
    callback = make_callback(make_model())
    logs = loop_run(model, callback, make_rows()[rank::world])
    cfp = callback.protection
    owned = {n: (p.numel(), f.numel(), t0.numel())
             for n, p, f, t0 in zip(callback.anchor.fisher, cfp.params, cfp.views["math"][1], cfp.theta0)}
    with FullyShardedDataParallel.summon_full_params(model):
        params = {canonical_name(n): p.detach().clone() for n, p in model.named_parameters()}
    flat = fsdp1_wrap(use_orig_params=False)  # flat parameters: pieces bound as views of the local shards
    flat_active = all(isinstance(p, FlatParameter) for p in flat.parameters())
    flat_callback = make_callback(make_model())
    flat_logs = loop_run(flat, flat_callback, make_rows()[rank::world])
    flat_owned = {n: (f.numel(), t0.numel()) for n, f, t0 in
                  zip(flat_callback.anchor.fisher, flat_callback.protection.views["math"][1], flat_callback.protection.theta0)}
    with FullyShardedDataParallel.summon_full_params(flat):
        flat_params = {canonical_name(n): p.detach().clone() for n, p in flat.named_parameters()}
    return {"fsdp1_logs": logs, "fsdp1_params": params, "fsdp1_active": active, "fsdp1_empty": empty,
            "fsdp1_all_sharded": all(cfp.sharded), "fsdp1_owned": owned,
            "fsdp1flat_logs": flat_logs, "fsdp1flat_params": flat_params, "fsdp1flat_active": flat_active,
            "fsdp1flat_all_sharded": all(flat_callback.protection.sharded), "fsdp1flat_owned": flat_owned}

if __name__ == "__main__":
    main(sys.argv[1])
