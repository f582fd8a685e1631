"""One process of `tests/integration/test_kfac_distributed.py`, launched by `torchrun --nproc_per_node 2` (gloo).

With each K-FAC anchor the test process estimated and saved (`<anchor>` at full rank, `<tailed>` at rank 3 with
the mean tails; loaded lazily here: under FSDP2 each process reads the rows of U_G it needs), and with `<tailed>`
and `<safety>` (rank 3, other prompts) protecting together (suffix `_summed`: the summed proximal map), it

- estimates the same K-FAC anchor on 2 processes (batches split, factor sums all-reduced): `estimated`, and a
  rank-3 one whose factors wider than 20 are sketched (sketches all-reduced, then refined): `sketched`;
- trains the tiny Llama under DDP (`transformers.Trainer`, the global batch split over the processes) and under
  FSDP2 (`fully_shard` per decoder layer and at the root, a plain loop calling the callback's hooks), protected
  by the K-FAC anchor and monitored by a diagonal one (`support.distributed.make_kfac_callback`);
- trains it under FSDP1 (one unit for the whole model, use_orig_params True and False: the halves of its flat
  parameter meet inside a row of layer 1's q_proj, and most weights are held whole by one process, empty by the
  other) in the same plain loop, protected by the one-anchor K-FAC anchors; with two summed anchors CFP refuses.

Each process saves what it saw to `<out>/rank<r>.pt`.
"""

import sys
from pathlib import Path

import torch
from support.distributed import (
    ROWS,
    estimate_kfac_anchor,
    fsdp1_full_params,
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

    for suffix, directory in (("", anchor), ("_tailed", tailed)):
        for mode, use_orig_params in (("fsdp1", True), ("fsdp1flat", False)):
            results.update(fsdp1_run(directory, rank, world, f"{mode}{suffix}", use_orig_params))
    try:
        fsdp1_run([tailed, safety], rank, world, "fsdp1_summed", True)
        results["fsdp1_summed_refusal"] = None
    except Exception as error:  # the refusal under test
        results["fsdp1_summed_refusal"] = (type(error).__name__, str(error))
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


def fsdp1_run(anchor, rank: int, world: int, mode: str, use_orig_params: bool) -> dict:
    """The tiny Llama under FSDP1 (one unit for the whole model) in a plain loop, protected by `anchor`:
    its logs, its full parameters after the run, and the K-FAC weights held as pieces that cut a row."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    model = FullyShardedDataParallel(
        make_model(),
        device_id=torch.device("cpu"),
        sync_module_states=False,
        use_orig_params=use_orig_params,
    )
    callback = make_kfac_callback(anchor)
    logs = loop_run(model, callback, make_rows()[rank::world])
    params = fsdp1_full_params(model)
    factored = [t for t in callback.protection.tensors if t.kfac]
    cut = [t.name for t in factored if t.held.start % t.kfac["math"].a_vectors.shape[0] and t.held.stop > t.held.start]
    # (start, stop, in, rows of U_G bound) of each K-FAC weight's piece
    rows = [
        (t.held.start, t.held.stop, t.kfac["math"].a_vectors.shape[0], t.kfac["math"].g_vectors.shape[0])
        for t in factored
    ]
    return {f"{mode}_logs": logs, f"{mode}_params": params, f"{mode}_cut": cut, f"{mode}_rows": rows}


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]))
