"""One process of `tests/integration/test_distributed.py`, launched by `torchrun --nproc_per_node 2` (gloo, CPU).

It trains the same tiny Llama with CFPCallback twice, each run splitting one global batch of
ROWS sequences evenly over the processes:

- DDP: `transformers.Trainer` with `use_cpu=True` (accelerate wraps the model in DDP);
- FSDP2: `fully_shard` per decoder layer and at the root, parameters are DTensors sharded on
  dim 0, driven by a plain loop that calls the callback's hooks as the Trainer does;
- FSDP1: `FullyShardedDataParallel(use_orig_params=True)` per decoder layer and at the root
  (parameters are 1-D views of this process's piece of a FlatParameter, some empty), same loop.
  On CPU it needs `device_id=torch.device("cpu")` and `sync_module_states=False`.

Each process saves what it saw to `<out>/rank<r>.pt`. The single-process references use the
same helpers (`trainer_run`, `loop_run`: tests/support/distributed.py) in the test process.
"""

import sys

import torch
from support.distributed import ROWS, loop_run, make_callback, make_model, make_rows, trainer_run


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
        for n, p, f, t0 in zip(callback.anchor.fisher, cfp.params, cfp.views["math"][1], cfp.theta0, strict=True)
    }
    results = {
        "ddp_logs": ddp_logs,
        "ddp_params": ddp_params,
        "fsdp2_logs": fsdp_logs,
        "fsdp2_params": {n: p.full_tensor().detach() for n, p in model.named_parameters()},
        "fsdp2_all_dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
        "fsdp2_all_sharded": all(cfp.sharded),
        "fsdp2_owned": owned,
    }
    results.update(fsdp1_case(rank, world))
    torch.save(results, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def fsdp1_wrap(use_orig_params):
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return FullyShardedDataParallel(
        make_model(),
        auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
        device_id=torch.device("cpu"),
        sync_module_states=False,
        use_orig_params=use_orig_params,
    )


def fsdp1_case(rank, world):
    """FSDP1 trained with the callback, with use_orig_params=True and with flat parameters (False)."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp._flat_param import FlatParameter

    from hf_cfp.anchor.fingerprint import check_fingerprint, model_fingerprint
    from hf_cfp.names import canonical_name

    model = fsdp1_wrap(use_orig_params=True)
    units = [m for m in model.modules() if isinstance(m, FullyShardedDataParallel) and m._handle is not None]
    active = (
        len(units) == 3
        and all(isinstance(m._handle.flat_param, FlatParameter) for m in units)
        and all(p.dim() == 1 for p in model.parameters())
    )
    empty = [canonical_name(n) for n, p in model.named_parameters() if p.numel() == 0]
    check_fingerprint(model_fingerprint(make_model()), model, "math")  # full shapes seen through the pieces
    callback = make_callback(make_model())
    logs = loop_run(model, callback, make_rows()[rank::world])
    cfp = callback.protection
    owned = {
        n: (p.numel(), f.numel(), t0.numel())
        for n, p, f, t0 in zip(callback.anchor.fisher, cfp.params, cfp.views["math"][1], cfp.theta0, strict=True)
    }
    with FullyShardedDataParallel.summon_full_params(model):
        params = {canonical_name(n): p.detach().clone() for n, p in model.named_parameters()}
    flat = fsdp1_wrap(use_orig_params=False)  # flat parameters: pieces bound as views of the local shards
    flat_active = all(isinstance(p, FlatParameter) for p in flat.parameters())
    flat_callback = make_callback(make_model())
    flat_logs = loop_run(flat, flat_callback, make_rows()[rank::world])
    flat_owned = {
        n: (f.numel(), t0.numel())
        for n, f, t0 in zip(
            flat_callback.anchor.fisher,
            flat_callback.protection.views["math"][1],
            flat_callback.protection.theta0,
            strict=True,
        )
    }
    with FullyShardedDataParallel.summon_full_params(flat):
        flat_params = {canonical_name(n): p.detach().clone() for n, p in flat.named_parameters()}
    return {
        "fsdp1_logs": logs,
        "fsdp1_params": params,
        "fsdp1_active": active,
        "fsdp1_empty": empty,
        "fsdp1_all_sharded": all(cfp.sharded),
        "fsdp1_owned": owned,
        "fsdp1flat_logs": flat_logs,
        "fsdp1flat_params": flat_params,
        "fsdp1flat_active": flat_active,
        "fsdp1flat_all_sharded": all(flat_callback.protection.sharded),
        "fsdp1flat_owned": flat_owned,
    }


if __name__ == "__main__":
    main(sys.argv[1])
