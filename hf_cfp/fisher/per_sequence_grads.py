"""Per-sequence gradients G_b of a parameter from one module call's (a_b, g_b), and their squared sum.

a_{b,t} is the module's input at position t of sequence b (for a norm: the weight direction
d(x_{b,t}); for an embedding: the token id i_{b,t}) and g_{b,t} the gradient of the score with
respect to the module's output there (module kinds: `module_kinds`). Then

- linear, y_t = W a_t + c:                 G_W[b] = sum_t g_{b,t} a_{b,t}^T,   G_c[b] = sum_t g_{b,t}
- GPT-2 Conv1D, y_t = W^T a_t + c:         G_W[b] = sum_t a_{b,t} g_{b,t}^T,   G_c[b] = sum_t g_{b,t}
- affine norm, y_t = y0(x_t) + w * d(x_t) + c:
                                           G_w[b] = sum_t g_{b,t} * d(x_{b,t}), G_c[b] = sum_t g_{b,t}
- embedding, y_t = c W[i_t]:               G[b] = c sum_t e_{i_{b,t}} g_{b,t}^T (rows sequence b uses)

`accumulate` sums the G_b of all uses of one parameter per sequence, squares, and adds
sum_b G_b^2 into the float32 accumulator, a chunk of sequences at a time, in place.
"""

from dataclasses import dataclass

import torch
from torch import nn

from .module_kinds import embedding_scale

__all__ = ["Use", "accumulate"]


@dataclass
class Use:
    """One use of a parameter: (x, g) of one call of its module, batch first."""

    kind: str
    role: str
    x: torch.Tensor
    g: torch.Tensor
    module: nn.Module

    @property
    def sparse(self) -> bool:
        return self.kind == "embedding"

    def per_sequence_size(self, param_numel: int) -> int:
        return self.g[0].numel() if self.sparse else param_numel

    def dense(self, b0: int, b1: int) -> torch.Tensor:
        """G_b for b in [b0, b1) (not for embeddings), shape (b1 - b0, *param.shape), float32."""
        return _DENSE[self.kind](self.role, _flat(self.x, b0, b1), _flat(self.g, b0, b1))

    def rows(self, b0: int, b1: int):
        """Embeddings only: G_b for b in [b0, b1) as sparse (keys, rows), see `_embedding_rows`."""
        assert isinstance(self.module, nn.Embedding)  # `module_kind` says "embedding" for these only
        return _embedding_rows(self.module, self.x[b0:b1], self.g[b0:b1])


def _flat(t: torch.Tensor, b0: int, b1: int) -> torch.Tensor:
    """Sequences b0..b1 as (c, positions, features) in float32."""
    t = t[b0:b1]
    return t.reshape(t.shape[0], -1, t.shape[-1]).float()


def _linear_grad(role, a, g):
    """nn.Linear, y_t = W a_t + c:  G_W[b] = sum_t g_{b,t} a_{b,t}^T,  G_c[b] = sum_t g_{b,t}."""
    return torch.bmm(g.transpose(1, 2), a) if role == "weight" else g.sum(1)


def _conv1d_grad(role, a, g):
    """GPT-2 Conv1D, y_t = W^T a_t + c with W of shape (in, out):  G_W[b] = sum_t a_{b,t} g_{b,t}^T,
    G_c[b] = sum_t g_{b,t}."""
    return torch.bmm(a.transpose(1, 2), g) if role == "weight" else g.sum(1)


def _norm_grad(role, d, g):
    """Affine norm, y_t = y0(x_t) + w * d(x_t) + c:  G_w[b] = sum_t g_{b,t} * d(x_{b,t}),
    G_c[b] = sum_t g_{b,t}. For RMSNorm / LayerNorm d(x) is the normalized input x_hat."""
    return (g * d).sum(1) if role == "weight" else g.sum(1)


_DENSE = {"linear": _linear_grad, "conv1d": _conv1d_grad, "norm": _norm_grad}


def _embedding_rows(module: nn.Embedding, ids: torch.Tensor, g: torch.Tensor):
    """nn.Embedding, y_t = c W[i_t] (c = 1, or a constant scale):
    G[b] = c sum_t e_{i_{b,t}} g_{b,t}^T, nonzero only on the rows sequence b uses.

    Returned sparse: (keys, rows) with key = local_b * vocab + i_{b,t} and row = c g_{b,t}; repeated
    keys are summed later. Positions holding padding_idx get no gradient, as in nn.Embedding."""
    local = torch.arange(ids.shape[0], device=ids.device).view(-1, *([1] * (ids.dim() - 1)))
    keys = (local * module.num_embeddings + ids).reshape(-1)
    rows = g.reshape(-1, g.shape[-1]).float()
    scale = embedding_scale(module)
    assert scale is not None  # `module_kind` says "embedding" only when the scale is known
    if scale != 1.0:
        rows = rows * scale
    if module.padding_idx is not None:
        keep = ids.reshape(-1) != module.padding_idx
        keys, rows = keys[keep], rows[keep]
    return keys, rows


def accumulate(acc: torch.Tensor, uses: list[Use], batch_size: int, max_chunk_elements: int) -> None:
    """acc += sum_b (sum_u G_{u,b})^2: the uses of one parameter are summed per sequence before squaring,
    in chunks of sequences whose per-sequence gradients hold at most max_chunk_elements elements (at
    least one sequence). Squares are added one sequence at a time, in sequence order, so the result
    does not depend on the chunk size, bit for bit."""
    sparse = all(use.sparse for use in uses)
    per_sequence = max(use.per_sequence_size(acc.numel()) for use in uses) if sparse else acc.numel()
    step = max(1, max_chunk_elements // max(1, per_sequence))
    for b0 in range(0, batch_size, step):
        b1 = min(batch_size, b0 + step)
        if sparse:
            _add_sparse_squares(acc, [use.rows(b0, b1) for use in uses])
        else:
            _add_dense_squares(acc, uses, b0, b1)


def _add_sparse_squares(acc: torch.Tensor, parts) -> None:
    """Embeddings: sum the rows per (sequence, row) key, square, scatter-add into acc (keys sorted,
    sequence-major, so each row of acc receives its sequences' squares in sequence order)."""
    keys = torch.cat([k for k, _ in parts])
    unique, inverse = keys.unique(return_inverse=True)
    summed = torch.zeros(len(unique), acc.shape[-1], dtype=torch.float32, device=acc.device)
    summed.index_add_(0, inverse, torch.cat([r for _, r in parts]))
    acc.index_add_(0, unique % acc.shape[0], summed.square_())


def _add_dense_squares(acc: torch.Tensor, uses: list[Use], b0: int, b1: int) -> None:
    """acc += G_b^2 for b in [b0, b1), G_b the sum of the dense uses' per-sequence gradients plus the
    rows of a tied embedding's uses (added into lm_head's G_b before squaring)."""
    dense = [use for use in uses if not use.sparse]
    total = dense[0].dense(b0, b1)
    for use in dense[1:]:
        total.add_(use.dense(b0, b1))
    for use in uses:
        if use.sparse:
            keys, rows = use.rows(b0, b1)
            total.view(-1, acc.shape[-1]).index_add_(0, keys, rows)
    for g in total:
        acc.addcmul_(g, g)
