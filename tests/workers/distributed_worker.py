"""One process of `tests/integration/test_distributed.py`, launched by `torchrun --nproc_per_node 2` (gloo, CPU).

It trains the same tiny Llama with CFPCallback twice, each run splitting one global batch of
ROWS sequences evenly over the processes:

- DDP: `transformers.Trainer` with `use_cpu=True` (accelerate wraps the model in DDP);
- FSDP2: `fully_shard` per decoder layer and at the root, parameters are DTensors sharded on
  dim 0, driven by a plain loop that calls the callback's hooks as the Trainer does;
- FSDP1: `FullyShardedDataParallel(use_orig_params=True)` per decoder layer and at the root
  (parameters are 1-D views of this process's piece of a FlatParameter, some empty), same loop.
  On CPU it needs `device_id=torch.device("cpu")` and `sync_module_states=False`.

Resuming, for every layout: the uninterrupted run (DDP: saving a checkpoint every RESUME_STEP
steps), a run interrupted after RESUME_STEP steps and resumed by a new callback from theta0 saved
by these 2 processes (DDP: a new Trainer resuming from a copy of the real checkpoint, in a fresh
output_dir; the loop layouts: `Resume`), and the negative control, resumed with
`restart_path_on_resume=True` from a checkpoint without theta0. The loop layouts also resume from
the directory `<one>` saved by the single test process, and restore theta0 through a CFPState from
it and from the one saved by FSDP2 (another layout's pieces), recording each piece with its range.

PEFT LoRA (`make_lora_model`: LoRA on q_proj / v_proj, lm_head through modules_to_save): trained under DDP
by the Trainer with lam > 0 (the LoRA factors corrected on every process), saving checkpoints, and resumed
from a copy of checkpoint-RESUME_STEP by a new Trainer and callback in a fresh output_dir; and bound on the same model
sharded by FSDP2 and by FSDP1 (use_orig_params=True), where CFP must refuse with a CFPError: `<kind>_refusal`
records the exception's type and message.

Each process saves what it saw to `<out>/rank<r>.pt`. The single-process references use the
same helpers (`trainer_run`, `loop_run`: tests/support/distributed.py) in the test process.
"""

import shutil
import sys
from functools import partial
from pathlib import Path

import torch
from support.distributed import (
    KL_BUDGET,
    RESUME_STEP,
    ROWS,
    Resume,
    fsdp1_full_params,
    held_theta0,
    loop_run,
    make_callback,
    make_lora_callback,
    make_lora_model,
    make_model,
    make_rows,
    make_state,
    trainable,
    trainer_run,
)
from transformers import TrainerControl, TrainerState

from hf_cfp.imports import is_peft_available
from hf_cfp.protection import SavedTheta0

RESUMES = (("resumed", False), ("restarted", True))  # DDP's (tag, restart_path_on_resume): resumed, negative control


def main(out, one):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from hf_cfp.parallel import local_tensor

    # DDP through the Trainer (it initializes the gloo process group).
    model = make_model()
    ddp_logs = trainer_run(
        model, [make_callback(model)], f"{out}/ddp", per_device_batch=ROWS // 2, save_steps=RESUME_STEP
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    ddp_params = {n: p.detach().clone() for n, p in model.named_parameters()}
    ddp_resumes = ddp_resume_case(out, rank)
    # kl_budget under DDP, both rules: every process draws and scores the same base responses, so lam stays replicated
    kl_runs = {}
    for rule in ("adaptive", "feedforward"):
        model = make_model()
        callback = make_callback(model, **KL_BUDGET, kl_control=rule)
        logs = trainer_run(model, [callback], f"{out}/ddp-kl-{rule}", per_device_batch=ROWS // 2)
        kl_runs[rule] = (logs, {n: p.detach().clone() for n, p in model.named_parameters()})

    # FSDP2: shard every decoder layer and the root; this process trains on its share of the rows.
    mesh = init_device_mesh("cpu", (world,))

    def fsdp2_model():
        model = make_model()
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    def fsdp2_params(model):
        return {n: p.full_tensor().detach() for n, p in model.named_parameters()}

    model = fsdp2_model()
    callback = make_callback(model)
    fsdp_logs = loop_run(model, callback, make_rows()[rank::world])
    cfp = callback.protection
    owned = {  # what this process keeps per parameter: (local numel, F numel, F bytes held, theta0 numel)
        n: (local_tensor(p).numel(), f.numel(), f.untyped_storage().nbytes(), t0.numel())
        for n, p, f, t0 in zip(
            callback.anchor.fisher, [t.param for t in cfp.tensors], cfp.views["math"].fisher, cfp.theta0, strict=True
        )
    }
    results = {
        "ddp_logs": ddp_logs,
        "ddp_params": ddp_params,
        **ddp_resumes,
        "ddp_kl": kl_runs,
        "fsdp2_logs": fsdp_logs,
        "fsdp2_params": fsdp2_params(model),
        "fsdp2_all_dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
        "fsdp2_all_sharded": all(t.sharded for t in cfp.tensors),
        "fsdp2_owned": owned,
    }
    reads = {"one": Path(one), "fsdp2": Path(out, "fsdp2_resumed")}  # theta0 saved by 1 process, by FSDP2
    results.update(loop_resume_case("fsdp2", fsdp2_model, fsdp2_params, out, rank, world, reads))
    results.update(fsdp1_case(rank, world, out, reads))
    if is_peft_available():  # the LoRA cases need the `peft` extra (their tests skip without it)
        results.update(lora_case(out, mesh))
    torch.save(results, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def ddp_resume_case(out, rank):
    """DDP resumed by a new Trainer and callback from a copy of checkpoint-RESUME_STEP (fresh output_dir),
    and the negative control: the same copy without theta0, restart_path_on_resume=True."""
    import torch.distributed as dist

    saved = Path(out, "ddp", f"checkpoint-{RESUME_STEP}")
    results = {"ddp_saved_files": sorted(p.name for p in saved.glob("cfp_theta0*"))}
    for tag, restart in RESUMES:
        moved = Path(out, f"ddp_{tag}_copy", "my-checkpoint")
        if rank == 0:
            shutil.copytree(saved, moved)
            for theta0_file in moved.glob("cfp_theta0*") if restart else ():
                theta0_file.unlink()
        dist.barrier()
        model = make_model()
        callback = make_callback(model, restart_path_on_resume=restart)
        results[f"ddp_{tag}_logs"] = trainer_run(
            model, [callback], f"{out}/ddp_{tag}", per_device_batch=ROWS // 2, resume=str(moved)
        )
        results[f"ddp_{tag}_params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        results[f"ddp_{tag}_theta0"] = held_theta0(callback.protection)
    return results


def loop_resume_case(mode, build, gather, out, rank, world, reads):
    """`mode` (a loop-driven layout) cut after RESUME_STEP steps and resumed by a new callback: from the
    theta0 these processes saved into <out>/<mode>_resumed ("resumed"), from the theta0 saved by one
    process ("from_one"), and the negative control: no theta0 saved, restart_path_on_resume=True
    ("restarted"). Then, on the resumed model (its weights far from theta0), theta0 restored from
    each directory of `reads` through a CFPState: `<mode>_read_<key>` = held_theta0 pieces."""
    results = {}
    variants = (  # (tag, checkpoint, save theta0 there, restart_path_on_resume); the resumed model last
        ("restarted", Path(out, f"{mode}_restarted"), False, True),
        ("from_one", reads["one"], False, False),
        ("resumed", Path(out, f"{mode}_resumed"), True, False),
    )
    for tag, checkpoint, save, restart in variants:
        model = build()
        new = make_callback(make_model(), restart_path_on_resume=restart)
        resume = Resume(RESUME_STEP, checkpoint, new, save)
        results[f"{mode}_{tag}_logs"] = loop_run(model, make_callback(make_model()), make_rows()[rank::world], resume)
        results[f"{mode}_{tag}_theta0"] = held_theta0(new.protection)
        results[f"{mode}_{tag}_params"] = gather(model)
    results[f"{mode}_saved_files"] = sorted(p.name for p in Path(out, f"{mode}_resumed").glob("cfp_theta0*"))
    for key, directory in reads.items():
        results[f"{mode}_read_{key}"] = held_theta0(make_state(model, theta0=SavedTheta0(directory)))
    return results


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


def fsdp1_case(rank, world, out, reads):
    """FSDP1 trained with the callback, with use_orig_params=True and with flat parameters (False),
    each also interrupted and resumed (`loop_resume_case`)."""
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
        for n, p, f, t0 in zip(
            callback.anchor.fisher, [t.param for t in cfp.tensors], cfp.views["math"].fisher, cfp.theta0, strict=True
        )
    }
    params = fsdp1_full_params(model)
    flat = fsdp1_wrap(use_orig_params=False)  # flat parameters: pieces bound as views of the local shards
    flat_active = all(isinstance(p, FlatParameter) for p in flat.parameters())
    flat_callback = make_callback(make_model())
    flat_logs = loop_run(flat, flat_callback, make_rows()[rank::world])
    flat_owned = {
        n: (f.numel(), t0.numel())
        for n, f, t0 in zip(
            flat_callback.anchor.fisher,
            flat_callback.protection.views["math"].fisher,
            flat_callback.protection.theta0,
            strict=True,
        )
    }
    flat_params = fsdp1_full_params(flat)

    resumes = {}
    for mode, use_orig_params in (("fsdp1", True), ("fsdp1flat", False)):
        build = partial(fsdp1_wrap, use_orig_params)
        resumes.update(loop_resume_case(mode, build, fsdp1_full_params, out, rank, world, reads))
    return {
        **resumes,
        "fsdp1_logs": logs,
        "fsdp1_params": params,
        "fsdp1_active": active,
        "fsdp1_empty": empty,
        "fsdp1_all_sharded": all(t.sharded for t in cfp.tensors),
        "fsdp1_owned": owned,
        "fsdp1flat_logs": flat_logs,
        "fsdp1flat_params": flat_params,
        "fsdp1flat_active": flat_active,
        "fsdp1flat_all_sharded": all(t.sharded for t in flat_callback.protection.tensors),
        "fsdp1flat_owned": flat_owned,
    }


def lora_case(out, mesh):
    """A LoRA model trained under DDP with lam > 0, and CFP's refusal of LoRA factors sharded by FSDP2 / FSDP1."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    model = make_lora_model()
    logs = trainer_run(
        model, [make_lora_callback()], f"{out}/lora_ddp", per_device_batch=ROWS // 2, save_steps=RESUME_STEP
    )
    results = {"lora_ddp_logs": logs, "lora_ddp_params": trainable(model)}
    saved, moved = Path(out, "lora_ddp", f"checkpoint-{RESUME_STEP}"), Path(out, "lora_ddp_copy", "my-checkpoint")
    results["lora_ddp_saved_files"] = sorted(p.name for p in saved.glob("cfp_theta0*"))
    if dist.get_rank() == 0:
        shutil.copytree(saved, moved)
    dist.barrier()
    resumed = make_lora_model()  # resumed by a new Trainer and callback into a fresh output_dir
    results["lora_ddp_resumed_logs"] = trainer_run(
        resumed, [make_lora_callback()], f"{out}/lora_ddp_resumed", per_device_batch=ROWS // 2, resume=str(moved)
    )
    results["lora_ddp_resumed_params"] = trainable(resumed)
    fsdp2 = make_lora_model()
    for layer in fsdp2.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(fsdp2, mesh=mesh)
    fsdp1 = FullyShardedDataParallel(
        make_lora_model(),
        auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
        device_id=torch.device("cpu"),
        sync_module_states=False,
        use_orig_params=True,  # False refuses a module mixing frozen and trained parameters itself
    )
    for kind, sharded in (("fsdp2", fsdp2), ("fsdp1", fsdp1)):
        try:
            make_lora_callback().on_train_begin(None, TrainerState(), TrainerControl(), model=sharded)
            results[f"lora_{kind}_refusal"] = ("bound", "")
        except Exception as error:  # recorded, the test checks it is a clear CFPError
            results[f"lora_{kind}_refusal"] = (type(error).__name__, str(error))
    return results


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
