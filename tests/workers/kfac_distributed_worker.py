"""One process of `tests/integration/test_kfac_distributed.py`, launched by `torchrun --nproc_per_node 2` (gloo).

With the K-FAC anchor the test process estimated and saved to `<anchor>` (loaded lazily here: under FSDP2 each
process reads the rows of Q_G it needs), it

- estimates the same K-FAC anchor on 2 processes (batches split, factor sums all-reduced): `estimated`;
- trains the tiny Llama under DDP (`transformers.Trainer`, the global batch split over the processes) and under
  FSDP2 (`fully_shard` per decoder layer and at the root, a plain loop calling the callback's hooks), protected
  by the K-FAC anchor and monitored by a diagonal one (`support.distributed.make_kfac_callback`);
- binds the K-FAC anchor on the model wrapped by FSDP1 (use_orig_params=True), where CFP must refuse.

Each process saves what it saw to `<out>/rank<r>.pt`.
"""

import sys
from pathlib import Path

import torch
from support.distributed import (
    ROWS,
    estimate_kfac_anchor,
    loop_run,
    make_kfac_callback,
    make_model,
    make_rows,
    trainer_run,
)


def main(out, anchor):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

    model = make_model()
    ddp_logs = trainer_run(model, [make_kfac_callback(anchor)], f"{out}/ddp", per_device_batch=ROWS // 2)
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {"ddp_logs": ddp_logs, "ddp_params": {n: p.detach().clone() for n, p in model.named_parameters()}}
    estimated = estimate_kfac_anchor(make_model())
    results["estimated"] = {n: estimated.kfac_factors(n) for n in estimated.kfac_names}
    results["estimated_fisher"] = dict(estimated.fisher)

    mesh = init_device_mesh("cpu", (world,))
    model = make_model()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    callback = make_kfac_callback(anchor)
    results["fsdp2_logs"] = loop_run(model, callback, make_rows()[rank::world])
    results["fsdp2_params"] = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
    results["fsdp2_sharded"] = [t.name for t in callback.protection.tensors if t.sharded and t.kfac]

    wrapped = FullyShardedDataParallel(make_model(), use_orig_params=True, device_id=torch.device("cpu"))
    try:
        loop_run(wrapped, make_kfac_callback(anchor), make_rows()[rank::world])
        results["fsdp1_refusal"] = None
    except Exception as error:  # the refusal under test
        results["fsdp1_refusal"] = (type(error).__name__, str(error))
    torch.save(results, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
