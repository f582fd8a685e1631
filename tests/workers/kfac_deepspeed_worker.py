"""One process of `tests/integration/test_kfac_deepspeed.py`, launched by `torchrun --nproc_per_node 2` on CPU.

DeepSpeed on CPU as in `deepspeed_worker.py` (whose `zero_trainer` it uses). With each K-FAC anchor the test process
saved (`<full>` at full rank, `<tailed>` at rank 3 with the mean tails; `support.distributed.make_kfac_callback`:
protected by it, a diagonal `code` anchor monitoring the MLPs), it trains the tiny Llama with `transformers.Trainer`
under

- ZeRO-2 (`zero2`, `zero2_tailed`): the model parameters whole on each process, the fp32 master copy of one
  parameter group (`one_group_optimizer`) split into fragments that meet inside a row;
- ZeRO-3 with every parameter partitioned (`zero3`, `zero3_tailed`; the tailed run saves a checkpoint every
  RESUME_STEP steps, and a new Trainer and callback resume from a copy of it: `zero3_tailed_resumed`), and with the
  default persistence thresholds (`zero3_persisted_tailed`: every tiny parameter stays gathered);

and with `<tailed>` and `<safety>` protecting together under ZeRO-2, where CFP must refuse (`zero2_summed_refusal`).

Each process saves what it saw to `<out>/rank<r>.pt`: per run its last logs, its gathered parameters, the largest
gap between the fp32 master fragments and the model parameters (ZeRO-2), and (start, stop, numel, in) of each
K-FAC weight's master fragment (`<run>_pieces`: elements [start, stop) of numel, in columns wide).
"""

import shutil
import sys
from functools import partial
from pathlib import Path

import torch
from deepspeed_worker import master_gap, zero_trainer
from support.distributed import RESUME_STEP, make_kfac_callback, make_model, zero3_full_params


def main(out, full, tailed, safety):
    from accelerate import PartialState

    PartialState(backend="gloo")
    import torch.distributed as dist

    results = {}
    for suffix, anchor in (("", full), ("_tailed", tailed)):
        results.update(run(out, f"zero2{suffix}", anchor, stage=2))
        save_steps = RESUME_STEP if suffix else None
        results.update(run(out, f"zero3{suffix}", anchor, stage=3, threshold=0, save_steps=save_steps))
    results.update(run(out, "zero3_persisted_tailed", tailed, stage=3))
    checkpoint = Path(out, "zero3_tailed", f"checkpoint-{RESUME_STEP}")
    moved = Path(out, "zero3_tailed_copy", "my-checkpoint")
    if dist.get_rank() == 0:
        shutil.copytree(checkpoint, moved)
    dist.barrier()
    results.update(run(out, "zero3_tailed_resumed", tailed, stage=3, threshold=0, resume=moved))
    try:
        run(out, "zero2_summed", [tailed, safety], stage=2)
        results["zero2_summed_refusal"] = ("trained", "")
    except Exception as error:  # recorded: the test checks it is a clear CFPArgumentError
        results["zero2_summed_refusal"] = (type(error).__name__, str(error))
    torch.save(results, f"{out}/rank{dist.get_rank()}.pt")
    dist.barrier()
    dist.destroy_process_group()


def run(out, tag, anchor, stage, threshold=None, save_steps=None, resume=None):
    """One Trainer run under ZeRO-`stage`, protected by `anchor`: what the module docstring lists, keyed `tag_*`."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()  # accelerate allows one DeepSpeed plugin per process: start over
    model = make_model()
    callback = make_kfac_callback(anchor)
    trainer = zero_trainer(stage, model, [callback], f"{out}/{tag}", threshold, save_steps)
    if stage == 2:  # one parameter group: its flat fp32 partitions meet inside a row of layer 1's q_proj
        trainer.create_optimizer = partial(one_group_optimizer, trainer)
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    fragments = callback.protection.kronecker_master.fragments
    widths = [fragment.kfac[name].a_vectors.shape[-2] for fragment in fragments for name in fragment.kfac]
    params = zero3_full_params(model)
    return {
        f"{tag}_logs": [h for h in trainer.state.log_history if "loss" in h][-1],
        f"{tag}_params": params,
        f"{tag}_pieces": [
            (f.held.start, f.held.stop, f.held.numel, w) for f, w in zip(fragments, widths, strict=True)
        ],
        f"{tag}_master_gap": master_gap(list(model.parameters())) if stage == 2 else -1.0,
    }


def one_group_optimizer(trainer):
    """The Trainer's AdamW (no weight decay, as its default) over every parameter in one group."""
    trainer.optimizer = torch.optim.AdamW(trainer.model.parameters(), lr=trainer.args.learning_rate, weight_decay=0.0)
    return trainer.optimizer


if __name__ == "__main__":
    main(*(Path(a) for a in sys.argv[1:5]))
