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

PEFT LoRA (`make_lora_model`, lam > 0): trained under ZeRO-2, where the LoRA factors corrected on the model
must also reach the optimizer's fp32 master copy (`zero2_lora_master_gap`: the largest difference left
between them); and bound under ZeRO-3, which partitions the factors: CFP must refuse with a CFPError
(`zero3_lora_refusal`: the exception's type and message).

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
    make_lora_callback,
    make_lora_model,
    make_model,
    make_rows,
    make_state,
    trainable,
    zero3_full_params,
)

from hf_cfp.imports import is_peft_available
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
    fingerprint = model_fingerprint(make_model())  # checked at train begin on the ZeRO-2/3 model

    def make_checked_callback(model):
        callback = make_callback(model)
        callback.anchor.metadata["base_fingerprint"] = fingerprint
        return callback

    saved = {**zero2_case(out, make_checked_callback), **zero3_cases(out, make_checked_callback)}
    saved.update(zero3_resume_case(out, one, rank))
    if is_peft_available():  # the LoRA cases need the `peft` extra (their tests skip without it)
        saved.update(lora_case(out))
    torch.save(saved, f"{out}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def zero2_case(out, make_checked_callback):
    """ZeRO-2 trained with the callback: logs, parameters, the optimizer DeepSpeed wrapped, the theta0 numel of the
    master-copy pieces, and the largest gap between the fp32 master copy and the corrected model parameters."""
    model = make_model()
    callback = make_checked_callback(model)
    trainer = zero_trainer(2, model, [callback], f"{out}/zero2")
    trainer.train()
    master = callback.protection.master
    return {
        "zero2_logs": [h for h in trainer.state.log_history if "loss" in h][-1],
        "zero2_params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "zero2_optimizer": type(trainer.optimizer.optimizer).__name__,
        "zero2_master_numel": sum(t.numel() for t in master.theta0) if master is not None else -1,
        "zero2_master_gap": master_gap(master.fragments if master is not None else []),
    }


def zero3_cases(out, make_checked_callback):
    """ZeRO-3 with tiny parameters persisting (the default) and with every parameter partitioned: what each process
    keeps of theta0 and F, logs, how many parameters persist, and the gathered parameters."""
    from accelerate.state import AcceleratorState

    results = {}
    for tag, threshold in (("zero3", None), ("zero3_partitioned", 0)):  # default: every tiny parameter persists
        AcceleratorState._reset_state()  # accelerate allows one DeepSpeed plugin per process: start over
        model = make_model()
        callback = make_checked_callback(model)
        save_steps = RESUME_STEP if tag == "zero3_partitioned" else None
        trainer = zero_trainer(3, model, [callback], f"{out}/{tag}", threshold, save_steps)
        trainer.train()
        # theta0 and F are kept for this process's partitions only
        results[f"{tag}_owned"] = (
            sum(t.numel() for t in callback.protection.theta0),
            sum(f.numel() for f in callback.protection.views["math"].fisher),
        )
        results[f"{tag}_logs"] = [h for h in trainer.state.log_history if "loss" in h][-1]
        results[f"{tag}_persisted"] = sum(bool(getattr(p, "ds_persist", False)) for p in model.parameters())
        results[f"{tag}_params"] = zero3_full_params(model)
    return results


def zero3_resume_case(out, one, rank):
    """ZeRO-3 (every parameter partitioned) resumed by a new Trainer and callback from a copy of
    checkpoint-RESUME_STEP, and the negative control (the copy without theta0, restart_path_on_resume=True);
    then theta0 restored on the resumed model from `one` (saved by 1 process) through a CFPState."""
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
        results[f"zero3_{tag}_params"] = zero3_full_params(model)
    results["zero3_read_one"] = held_theta0(make_state(model, theta0=SavedTheta0(one)))
    return results


def master_gap(params):
    """The largest |fp32 master fragment - model parameter fragment| over the ZeRO-1/2 `params` (-1 if none)."""
    gaps = [-1.0]
    for p in params:
        if p._hp_mapping is None:  # this process owns no part of p's master copy
            continue
        address = p._hp_mapping.lp_fragment_address
        model_part = p.detach().reshape(-1)[address.start : address.start + address.numel]
        gaps.append((p._hp_mapping.get_hp_fragment() - model_part).abs().max().item() if address.numel else 0.0)
    return max(gaps)


def lora_case(out):
    """A LoRA model trained under ZeRO-2 with lam > 0, and CFP's refusal of LoRA factors partitioned by ZeRO-3."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()
    model = make_lora_model()
    trainer = zero_trainer(2, model, [make_lora_callback()], f"{out}/zero2_lora")
    trainer.train()
    results = {
        "zero2_lora_logs": [h for h in trainer.state.log_history if "loss" in h][-1],
        "zero2_lora_params": trainable(model),
        "zero2_lora_master_gap": master_gap([p for p in model.parameters() if p.requires_grad]),
    }
    AcceleratorState._reset_state()
    trainer = zero_trainer(3, make_lora_model(), [make_lora_callback()], f"{out}/zero3_lora", persistence_threshold=0)
    try:
        trainer.train()
        results["zero3_lora_refusal"] = ("trained", "")
    except Exception as error:  # recorded, the test checks it is a clear CFPError
        results["zero3_lora_refusal"] = (type(error).__name__, str(error))
    return results


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
