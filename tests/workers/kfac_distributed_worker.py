"""One process of `tests/integration/test_kfac_distributed.py`, launched by `torchrun --nproc_per_node 2` (gloo).

With each K-FAC anchor the test process estimated and saved (`<anchor>` at full rank, `<tailed>` at rank 3 with
the mean tails; loaded lazily here: under FSDP2 each process reads the rows of U_G it needs), and with `<tailed>`
and `<safety>` (rank 3, other prompts) protecting together (suffix `_summed`: the summed proximal map), it

- estimates the same K-FAC anchor on 2 processes (batches split, factor sums all-reduced): `estimated`, and a
  rank-3 one whose factors wider than 20 are sketched (sketches all-reduced, then refined): `sketched`;
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


def main(out, anchor, tailed, safety):
    import torch.distributed as dist

    from hf_cfp.geometry.kronecker import factors as kfac_factors

    results = {}
    for suffix, directory in (("", anchor), ("_tailed", tailed), ("_summed", [tailed, safety])):
        model = make_model()
        callback = make_kfac_callback(directory)
        results[f"ddp{suffix}_logs"] = trainer_run(model, [callback], f"{out}/ddp{suffix}", per_device_batch=ROWS // 2)
        rank, world = dist.get_rank(), dist.get_world_size()  # the Trainer initialized the process group
        results[f"ddp{suffix}_params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        protection = callback.protection
        results[f"ddp{suffix}_owned"] = [sum(g.owned) for g in protection.kronecker.groups] + [
            sum(protection.summed.owned)
        ]
        results.update(fsdp2_run(directory, rank, world, suffix))
    estimated = estimate_kfac_anchor(make_model())
    results["estimated"] = {n: estimated.kfac_factors(n) for n in estimated.kfac_names}
    results["estimated_fisher"] = dict(estimated.fisher)
    kfac_factors.MAX_FORMED_DIMENSION = 20  # the MLP's 32-wide factors and lm_head's G are sketched
    sketched = estimate_kfac_anchor(make_model(), rank=3)
    results["sketched"] = {n: sketched.kfac_factors(n) for n in sketched.kfac_names}

    from torch.distributed.fsdp import FullyShardedDataParallel

    wrapped = FullyShardedDataParallel(make_model(), use_orig_params=True, device_id=torch.device("cpu"))
    try:
        loop_run(wrapped, make_kfac_callback(anchor), make_rows()[rank::world])
        results["fsdp1_refusal"] = None
    except Exception as error:  # the refusal under test
        results["fsdp1_refusal"] = (type(error).__name__, str(error))
    torch.save(results, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def fsdp2_run(anchor, rank: int, world: int, suffix: str) -> dict:
    """The tiny Llama under FSDP2 (`fully_shard` per decoder layer and at the root) in a plain loop, protected by
    `anchor`: its logs, its full parameters after the run, and the weights whose rows were sharded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = make_model()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    callback = make_kfac_callback(anchor)
    return {
        f"fsdp2{suffix}_logs": loop_run(model, callback, make_rows()[rank::world]),
        f"fsdp2{suffix}_params": {n: p.full_tensor().detach() for n, p in model.named_parameters()},
        f"fsdp2{suffix}_sharded": [t.name for t in callback.protection.tensors if t.sharded and t.kfac],
        f"fsdp2{suffix}_summed": [t.name for t in callback.protection.summed.tensors],
    }


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]))
