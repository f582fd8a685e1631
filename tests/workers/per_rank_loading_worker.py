"""One process of `tests/integration/test_per_rank_loading.py`, launched by `torchrun --nproc_per_node 2` (gloo, CPU).

The anchor saved by the test process (`sys.argv[2]`, over every parameter of `per_rank_model()`) is bound to the
model sharded by FSDP2 (`fully_shard` per decoder layer and at the root) and by FSDP1 (use_orig_params=True):

- loaded lazily, as CFPCallback loads a directory: the peak resident set's rise while loading + binding, and the
  bytes the anchor read (`LazyFisher.bytes_read`);
- loaded whole (`FisherAnchor.from_pretrained` without lazy): the same peak, for comparison;
- a CFPState over each, for the free-drift threshold (computed from the full F, streamed from the files).

Each process saves what it bound, read and measured to `<out>/rank<r>.pt`.
"""

import sys

import torch
from benchkit.resident import peak_rss_increase
from support.distributed import per_rank_model

from hf_cfp import FisherAnchor
from hf_cfp.geometry.diagonal.binding import bind_anchor
from hf_cfp.protection import CFPState


def bound_pieces(bound):
    return [(t.name, t.held.start, t.held.stop, t.fisher.reshape(-1).clone()) for t in bound]


def main(out, anchor_dir):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    fsdp2 = per_rank_model()
    for layer in fsdp2.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(fsdp2, mesh=mesh)

    def load_and_bind(lazy, model):
        anchor = FisherAnchor.from_pretrained(anchor_dir, lazy=lazy)
        return anchor, bind_anchor(anchor, model)

    (anchor, bound), lazy_peak = peak_rss_increase(lambda: load_and_bind(True, fsdp2))
    results = {"fsdp2": bound_pieces(bound), "fsdp2_bytes_read": anchor.fisher.bytes_read, "lazy_peak": lazy_peak}
    # `bound` is kept alive, so that loading whole cannot reuse its memory unseen
    _, results["eager_peak"] = peak_rss_increase(lambda: load_and_bind(False, fsdp2))
    for lazy in (True, False):
        state = CFPState(fsdp2, FisherAnchor.from_pretrained(anchor_dir, lazy=lazy))
        results[f"{'lazy' if lazy else 'eager'}_threshold"] = state.views["math"].threshold
    fsdp1 = FullyShardedDataParallel(
        per_rank_model(),
        auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
        device_id=torch.device("cpu"),
        sync_module_states=False,
        use_orig_params=True,
    )
    anchor, bound = load_and_bind(True, fsdp1)
    results.update(fsdp1=bound_pieces(bound), fsdp1_bytes_read=anchor.fisher.bytes_read)
    torch.save(results, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
