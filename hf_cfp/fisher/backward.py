"""The batched engine's backward: output gradients consumed as autograd delivers them.

The engine needs g = d(sum_b log mu_b)/d(out) for every hooked call's output, and nothing else:
no weight gradient. Differentiating with respect to all the outputs at once would hold every g
until the backward ends (all of them, about the size of the activations, beside the logits). Here
a tensor hook on each output receives its g as soon as autograd has it, and autograd is asked
only for the outputs below which no other call lies (`_sink_outputs`), so the rest of the g are
never collected: each is used, then released, while the backward goes on.
"""

from collections import Counter
from collections.abc import Mapping

import torch

from ..geometry.base import LayerSums
from .per_sequence_grads import Use, accumulate

__all__ = ["Consumer"]


class Consumer:
    """Consumes each call's output gradient g in a tensor hook, as autograd delivers it.

    A parameter's uses (a, g) wait in `pending` until the last one arrives (every reachable call
    of its module); then `accumulate` adds sum_b (sum_u G_{u,b})^2 and they are released. A use
    whose gradient never arrives (autograd found it undefined: zero) is left out, in `flush`."""

    def __init__(
        self,
        calls,
        owners,
        fallback,
        accumulators,
        batch_size,
        max_chunk_elements,
        layers: Mapping[int, LayerSums],
        mask: torch.Tensor,
    ):
        """`layers`: the weights whose output gradients go to their layer sums at the unpadded positions (`mask`,
        (B, T)) of each call (`LayerSums.add_output_grads`) instead of their per-sequence squares."""
        self.calls, self.owners, self.fallback = calls, owners, fallback
        self.accumulators, self.batch_size, self.max_chunk_elements = accumulators, batch_size, max_chunk_elements
        self.layers, self.mask = layers, mask
        self.pending: dict[int, list[Use]] = {}
        self.remaining = Counter(i for c in calls for _, i in self._covered(c) if i not in layers)

    def _covered(self, call):
        return [(role, i) for role, i in self.owners[call.module][1].items() if i not in self.fallback]

    def backward(self, total: torch.Tensor) -> None:
        """Run the activation-only backward of `total` with the hooks, then flush what is left."""
        handles = [call.out.register_hook(self._hook(call)) for call in self.calls]
        sinks = _sink_outputs(self.calls)
        for call in self.calls:
            call.out = None  # autograd keeps what it needs; the logits can go now
        try:
            torch.autograd.grad(total, sinks, allow_unused=True)
        finally:
            for handle in handles:
                handle.remove()
        self.flush()

    def _hook(self, call):
        def deliver(g):
            with torch.no_grad():
                self._deliver(call, g)

        return deliver

    def _deliver(self, call, g) -> None:
        kind = self.owners[call.module][0]
        x, call.x = call.x.detach(), None
        for role, i in self._covered(call):
            if i in self.layers:
                self.layers[i].add_output_grads(g, self.mask)
                continue
            self.pending.setdefault(i, []).append(Use(kind, role, x, g, call.module))
            self.remaining[i] -= 1
            if self.remaining[i] == 0:
                self._accumulate(i)

    def _accumulate(self, i) -> None:
        accumulate(self.accumulators[i], self.pending.pop(i), self.batch_size, self.max_chunk_elements)

    def flush(self) -> None:
        for i in list(self.pending):
            self._accumulate(i)


def _sink_outputs(calls) -> list[torch.Tensor]:
    """The outputs to differentiate with respect to so that autograd computes every call's output
    gradient: autograd runs a node only on a path from the root to a requested output, and every
    call whose grad_fn reaches another call's grad_fn lies on such a path. So request only the
    calls from which no other call is reachable (for a language model: the embedding's output)."""
    nodes = {call.out.grad_fn for call in calls}
    below: dict = {}  # node -> whether some call's node is reachable from it (excluding itself)
    stack = [(node, False) for node in nodes]
    while stack:
        node, expanded = stack.pop()
        if node in below and not expanded:
            continue
        children = [child for child, _ in node.next_functions if child is not None]
        if expanded:
            below[node] = any(child in nodes or below[child] for child in children)
        else:
            below.setdefault(node, False)
            stack.append((node, True))
            stack.extend((child, False) for child in children if child not in below)
    return [call.out for call in calls if not below[call.out.grad_fn]]
