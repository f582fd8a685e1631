"""One process of `tests/integration/test_deepspeed.py`, launched by `torchrun --nproc_per_node 2` on CPU.

DeepSpeed on CPU: `DS_ACCELERATOR=cpu`, `ACCELERATE_USE_DEEPSPEED=true` (set by the test), a gloo
process group made by `PartialState(backend="gloo")` before the Trainer, and
`TrainingArguments(use_cpu=False, accelerator_config={"use_configured_state": True})`.

- ZeRO-2: `transformers.Trainer` with CFPCallback (the same tiny Llama, anchors, lam and global
  batch as `distributed_worker.py`: tests/support/distributed.py), each process training on half
  of the global batch.
- ZeRO-3: the same, with the default persistence thresholds (every tiny parameter stays gathered)
  and with `stage3_param_persistence_threshold: 0` (every parameter partitioned). The partitioned
  run saves a checkpoint every RESUME_STEP steps; a new Trainer and callback resume from a copy
  of checkpoint-RESUME_STEP into a fresh output_dir, and, as the negative control, from a copy
  without theta0 with `restart_path_on_resume=True`. On the resumed model, theta0 is also restored
  through a CFPState from the directory `<one>` saved by the single test process.

Each process saves what it saw to `<out>/rank<r>.pt`.
"""

import shutil
import sys
from pathlib import Path

import torch
from support.distributed import (
    LR,
    RESUME_STEP,
    ROWS,
    STEPS,
    held_theta0,
    make_callback,
    make_model,
    make_rows,
    make_state,
)

from hf_cfp.protection import SavedTheta0

DS_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_allow_untested_optimizer": True,  # the Trainer's torch AdamW, as in the single-process run
}


def zero_trainer(stage, model, callbacks, output_dir, persistence_threshold=None, save_steps=None):
    zero = {"stage": stage}
    if persistence_threshold is not None:
        zero["stage3_param_persistence_threshold"] = persistence_threshold
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=output_dir,
        max_steps=STEPS,
        per_device_train_batch_size=ROWS // 2,
        learning_rate=LR,
        use_cpu=False,
        report_to="none",
        logging_steps=1,
        **({"save_strategy": "steps", "save_steps": save_steps} if save_steps else {"save_strategy": "no"}),
        seed=0,
        disable_tqdm=True,
        deepspeed={**DS_CONFIG, "zero_optimization": zero},
        accelerator_config={"use_configured_state": True},
    )
    return Trainer(model=model, args=args, train_dataset=make_rows(), callbacks=callbacks)


def main(out, one):
    from accelerate import PartialState

    PartialState(backend="gloo")
    import torch.distributed as dist

    from hf_cfp.anchor.fingerprint import model_fingerprint

    rank = dist.get_rank()
    saved = {}
    fingerprint = model_fingerprint(make_model())  # checked at train begin on the ZeRO-2/3 model

    def make_checked_callback(model):
        callback = make_callback(model)
        callback.anchor.metadata["base_fingerprint"] = fingerprint
        return callback

    model = make_model()
    callback = make_checked_callback(model)
    trainer = zero_trainer(2, model, [callback], f"{out}/zero2")
    trainer.train()
    master = callback.protection.master
    saved["zero2_logs"] = [h for h in trainer.state.log_history if "loss" in h][-1]
    saved["zero2_params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    saved["zero2_optimizer"] = type(trainer.optimizer.optimizer).__name__
    saved["zero2_master_numel"] = sum(t.numel() for t in master.theta0) if master is not None else -1
    # The fp32 master copy agrees with the corrected model parameters.
    saved["zero2_master_gap"] = (
        max(
            (
                p._hp_mapping.get_hp_fragment()
                - p.detach().reshape(-1)[p._hp_mapping.lp_fragment_address.start :][
                    : p._hp_mapping.lp_fragment_address.numel
                ]
            )
            .abs()
            .max()
            .item()
            for p in master.fragments
        )
        if master is not None and master.fragments
        else -1.0
    )

    import deepspeed
    from accelerate.state import AcceleratorState

    for tag, threshold in (("zero3", None), ("zero3_partitioned", 0)):  # default: every tiny parameter persists
        AcceleratorState._reset_state()  # accelerate allows one DeepSpeed plugin per process: start over
        model = make_model()
        callback = make_checked_callback(model)
        save_steps = RESUME_STEP if tag == "zero3_partitioned" else None
        trainer = zero_trainer(3, model, [callback], f"{out}/{tag}", threshold, save_steps)
        trainer.train()
        # theta0 and F are kept for this process's partitions only
        saved[f"{tag}_owned"] = (
            sum(t.numel() for t in callback.protection.theta0),
            sum(f.numel() for f in callback.protection.views["math"][1]),
        )
        saved[f"{tag}_logs"] = [h for h in trainer.state.log_history if "loss" in h][-1]
        saved[f"{tag}_persisted"] = sum(bool(getattr(p, "ds_persist", False)) for p in model.parameters())
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            saved[f"{tag}_params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    saved.update(zero3_resume_case(out, one, rank))
    torch.save(saved, f"{out}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def zero3_resume_case(out, one, rank):
    """ZeRO-3 (every parameter partitioned) resumed by a new Trainer and callback from a copy of
    checkpoint-RESUME_STEP, and the negative control (the copy without theta0, restart_path_on_resume=True);
    then theta0 restored on the resumed model from `one` (saved by 1 process) through a CFPState."""
    import deepspeed
    import torch.distributed as dist
    from accelerate.state import AcceleratorState

    saved = Path(out, "zero3_partitioned", f"checkpoint-{RESUME_STEP}")
    results = {"zero3_saved_files": sorted(p.name for p in saved.glob("cfp_theta0*"))}
    for tag, restart in (("restarted", True), ("resumed", False)):  # the resumed model last, for the read below
        moved = Path(out, f"zero3_{tag}_copy", "my-checkpoint")
        if rank == 0:
            shutil.copytree(saved, moved)
            for theta0_file in moved.glob("cfp_theta0*") if restart else ():
                theta0_file.unlink()
        dist.barrier()
        AcceleratorState._reset_state()
        model = make_model()
        callback = make_callback(model, restart_path_on_resume=restart)
        trainer = zero_trainer(3, model, [callback], f"{out}/zero3_{tag}", persistence_threshold=0)
        trainer.train(resume_from_checkpoint=str(moved))
        results[f"zero3_{tag}_logs"] = [h for h in trainer.state.log_history if "loss" in h][-1]
        results[f"zero3_{tag}_theta0"] = held_theta0(callback.protection)
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            results[f"zero3_{tag}_params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    results["zero3_read_one"] = held_theta0(make_state(model, theta0=SavedTheta0(one)))
    return results


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
