"""The control methods the evidence table compares CFP with (everything in the table that is not CFP).

- `isotropic_anchor`: CFP with F replaced by its mean, F_iso_i = (1/n) sum_j F_j (same total mass, no
  shape): run it through `CFPCallback` to ask whether the Fisher's shape matters, not only its scale.
- `truncated_anchor`: a K-FAC anchor cut to the top r eigenpairs of each factor, the rest free (zero tail) or at
  their mean (mean tail); `share_truncated_anchor`: per factor the fewest eigenpairs holding a share of its trace,
  mean tail (the rank and tail sweep); `floats_per_param`: what K-FAC bases store per factored parameter.
- `StepOnlyCallback`: the step-only variant, which preconditions the latest step instead of the path,
  theta_{t+1} = theta_t + d_t / (1 + lam F).
- `KLPenaltySFTTrainer`: supervised fine-tuning with a token-level KL penalty to a frozen reference model,
  loss = CE + beta * KLbar.
"""

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as nnf
from torch import nn
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from hf_cfp.anchor import FisherAnchor, check_fingerprint
from hf_cfp.errors import CFPArgumentError, CFPError
from hf_cfp.geometry.kronecker.artifact import truncate_basis, with_tails
from hf_cfp.geometry.kronecker.basis import KroneckerBasis
from hf_cfp.integrations.strength import check_lam
from hf_cfp.ops import proximal_pull_
from hf_cfp.parallel.deepspeed import uses_deepspeed
from hf_cfp.protection import bind_anchor, peft_view

IGNORE_INDEX = -100  # the label of positions the cross-entropy skips (transformers' convention)


def isotropic_anchor(anchor: FisherAnchor, name: str = "isotropic") -> FisherAnchor:
    """`anchor` with every coordinate's F replaced by the mean over all its n coordinates:

        F_iso_i = (1/n) sum_j F_j   (the sum in float64, stored as float32).

    Same tensor names and shapes, the same total mass sum_i F_i, no shape: `CFPCallback(isotropic_anchor(a),
    lam)` is CFP with F replaced by its mean, i.e. theta0 + (theta' - theta0) / (1 + lam * mean F) on every
    covered coordinate. The metadata is copied (so `base_fingerprint` still binds it to the same base model)
    with `derived_from` (the anchor's name) and `transform` ("isotropic mean") added.
    """
    total = sum(float(f.double().sum()) for f in anchor.fisher.values())
    mean = total / sum(f.numel() for f in anchor.fisher.values())
    fisher = {n: torch.full_like(f, mean) for n, f in anchor.fisher.items()}
    metadata = {**anchor.metadata, "derived_from": anchor.name, "transform": "isotropic mean"}
    return FisherAnchor(fisher, name=name, metadata=metadata)


def truncated_anchor(anchor: FisherAnchor, rank: int, name: str, tail: str = "zero") -> FisherAnchor:
    """K-FAC `anchor` with each factor's top `rank` eigenpairs (`hf_cfp.geometry.kronecker.artifact.truncate_basis`;
    the stored bases are largest first) and `tail` for the directions left out:

        A_r = U_A diag(alpha[:r]) U_A^T + rho_A (I - U_A U_A^T),   the same for G,

    rho = 0 with `tail="zero"` (the rest free: CFP pulls on the top r x r block of each weight's rotated coordinates
    alone), rho = (tr A - sum alpha[:r]) / (in - r) with `tail="mean"` (trace-preserving; CFP's exact four-block
    map, `hf_cfp.geometry.kronecker.basis`). A zero tail is kept as no tail at all: the same quadratic and correction,
    on the two-matmul path that made the committed `math_r<r>` rows. A factor of dimension <= rank stays whole. The
    diagonal F of its other parameters is unchanged. The metadata is copied with `kfac_rank`, `kfac_tail`,
    `kfac_floats_per_param`, `derived_from` (the anchor's name) and `transform` added.
    """
    bases = {key: truncate_basis(b, rank, tail) for key, b in anchor.kfac.items()}
    if tail == "zero":
        bases = {key: replace(b, a_tail=None, g_tail=None) for key, b in bases.items()}
    rest = "the rest free" if tail == "zero" else "the rest at their mean"
    transform = f"top {rank} eigenpairs per factor, {rest}"
    metadata = {**anchor.metadata, "kfac_rank": rank, "kfac_tail": tail}
    return _derived(anchor, name, bases, metadata, transform)


def share_rank(values: torch.Tensor, tail: torch.Tensor, dim: int, share: float) -> int:
    """The fewest of a factor's eigenvalues `values` (largest first; the `dim - len(values)` others at `tail`) whose
    sum holds >= `share` of its trace (float64), at least 1, at most len(values)."""
    kept = values.double().cumsum(0)
    trace = float(kept[-1]) + float(tail) * (dim - values.numel())
    short = int((kept < share * trace).sum())  # the eigenpairs before the share is reached
    return max(1, min(short + 1, values.numel()))


def share_truncated_anchor(anchor: FisherAnchor, share: float, name: str) -> FisherAnchor:
    """K-FAC `anchor` with each factor cut to the fewest top eigenpairs whose eigenvalues hold >= `share` (0 < share
    <= 1) of that factor's trace (`share_rank`), the rest at their mean (`truncated_anchor`'s mean tail): A and G
    of one weight, and different weights, keep different ranks. The metadata is copied with `kfac_share`,
    `kfac_tail` ("mean"), `kfac_factor_ranks` ({weight: [rank of A, rank of G]}), `kfac_floats_per_param`,
    `derived_from` and `transform` added."""
    if not 0 < share <= 1:
        raise ValueError(f"share={share!r}: a fraction of the trace in (0, 1]")
    bases, ranks = {}, {}
    for key, b in anchor.kfac.items():
        rho_a, rho_g = b.tails()
        r_a = share_rank(b.a_values, rho_a, b.a_vectors.shape[-2], share)
        r_g = share_rank(b.g_values, rho_g, b.g_vectors.shape[-2], share)
        a, g = truncate_basis(b, r_a, "mean"), truncate_basis(b, r_g, "mean")
        bases[key] = with_tails(a.a_values, a.a_vectors, a.a_tail, g.g_values, g.g_vectors, g.g_tail)
        ranks[key] = [r_a, r_g]
    transform = f"per factor the fewest eigenpairs holding >= {share:.0%} of its trace, the rest at their mean"
    metadata = {**anchor.metadata, "kfac_share": share, "kfac_tail": "mean", "kfac_factor_ranks": ranks}
    return _derived(anchor, name, bases, metadata, transform)


def _derived(anchor: FisherAnchor, name: str, bases: dict, metadata: dict, transform: str) -> FisherAnchor:
    """The anchor of `bases` and `anchor`'s diagonal F, its metadata with what was done added."""
    metadata |= {
        "kfac_floats_per_param": floats_per_param(bases),
        "derived_from": anchor.name,
        "transform": transform,
    }
    return FisherAnchor(dict(anchor.fisher), name=name, metadata=metadata, kfac=bases)


def floats_per_param(bases: Mapping[str, KroneckerBasis]) -> float:
    """The floats K-FAC bases (`FisherAnchor.kfac`) store, eigenvectors, eigenvalues and tails, per parameter of
    the weights they factor (out x in each; the anchor's diagonal parameters left out): (in^2 + out^2 + in + out)
    / (in out) at full rank (about 3 for an MLP weight), about (in + out) r / (in out) at rank r."""
    floats = params = 0
    for b in bases.values():
        parts = (b.a_vectors, b.a_values, b.g_vectors, b.g_values, b.a_tail, b.g_tail)
        floats += sum(t.numel() for t in parts if t is not None)
        params += b.a_vectors.shape[-2] * b.g_vectors.shape[-2]
    return floats / params if params else 0.0


class StepOnlyCallback(TrainerCallback):
    r"""
    The step-only control: after every optimizer step, only that step is preconditioned, not the path.

    $$\theta_{t+1} = \theta_t + \frac{d_t}{1 + \lambda F}, \qquad d_t = \theta'_{t+1} - \theta_t$$

    with theta' the optimizer's proposal and F the anchor's diagonal Fisher; equivalently lerp(theta', theta_t, w),
    w = lam F / (1 + lam F), the CFP correction (`hf_cfp.ops.proximal_pull_`) with theta_t in place of theta0.
    Under a constant proposal d the displacement grows linearly, t * d / (1 + lam F), where CFP's converges to
    d / (lam F): the contrast the paper draws. Coordinates with F = 0 (all of them when lam = 0) keep the
    optimizer's proposal exactly.

    A float32 copy of the covered parameters after the previous step (theta_t) is taken at train begin and
    refreshed after each correction, so no `on_step_begin` hook is needed. Plain models only: PEFT models,
    sharded parameters and DeepSpeed raise `CFPArgumentError`.

    To log drift, add a measuring `CFPCallback(anchor, lam=0.0, monitor=[...])` and list it after this callback,
    `callbacks=[StepOnlyCallback(anchor, lam), CFPCallback(anchor, lam=0.0)]`, so that a callback acting in
    `on_step_end` sees the corrected weights. (The Trainer calls `on_log`, where CFPCallback measures, after every
    callback's `on_step_end`, so the logged drift is that of the corrected weights in either order.)

    Args:
        anchor ([`FisherAnchor`]): the Fisher F, keyed by the model's parameter names.
        lam (`float`): the strength lam >= 0.
    """

    def __init__(self, anchor: FisherAnchor, lam: float):
        if not isinstance(anchor, FisherAnchor):
            raise CFPArgumentError(f"StepOnlyCallback needs a FisherAnchor, got {type(anchor).__name__}.")
        self.anchor = anchor
        self.lam = check_lam(lam)
        # (params, theta_t, F) per (device, dtype) of the covered parameters; set at train begin
        self.groups: list[tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]] | None = None

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        model = kwargs["model"]
        if peft_view(model) is not None or uses_deepspeed(model, args):
            raise CFPArgumentError("StepOnlyCallback supports plain models only, not PEFT models or DeepSpeed.")
        check_fingerprint(self.anchor.metadata.get("base_fingerprint"), model, self.anchor.name)
        by_kind: defaultdict[tuple, tuple[list, list]] = defaultdict(lambda: ([], []))
        for bound in bind_anchor(self.anchor, model):
            if bound.sharded:
                raise CFPArgumentError(
                    f"StepOnlyCallback: parameter {bound.name!r} is sharded across processes; plain models only."
                )
            params, fisher = by_kind[(bound.param.device, bound.param.dtype)]
            params.append(bound.param)
            fisher.append(bound.fisher)
        self.groups = [
            (params, [p.detach().float().clone() for p in params], fisher) for params, fisher in by_kind.values()
        ]

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.groups is None:
            raise CFPError("StepOnlyCallback.on_step_end before on_train_begin: the anchor was never bound.")
        with torch.no_grad():
            for params, previous, fisher in self.groups:
                proximal_pull_(params, previous, [[f] for f in fisher], [self.lam])
                torch._foreach_copy_(previous, params)


class KLPenaltySFTTrainer(Trainer):
    r"""
    Supervised fine-tuning with a KL penalty to a frozen reference model (the KL control of the evidence table):

    $$L = \mathrm{CE} + \beta\,\overline{\mathrm{KL}}, \qquad
      \overline{\mathrm{KL}} = \frac{1}{N} \sum_{t:\ \ell_{t+1} \ne -100} \sum_v p_{\theta,v}(x_{\le t})
      \big(\log p_{\theta,v}(x_{\le t}) - \log p_{\mathrm{ref},v}(x_{\le t})\big)$$

    the full-vocabulary token KL(pi_theta(.|ctx_t) || pi_ref(.|ctx_t)) at every position whose next-token label
    ell_{t+1} is scored by the cross-entropy, averaged the way the CE is: over the `num_items_in_batch` labels of
    the accumulated batch when the Trainer passes that count to the model, otherwise over this batch's N labels.
    No gradient flows through the reference, which is moved to the training device and put in eval mode. Every
    mean KLbar of a training batch is averaged into `kl_penalty` in the Trainer's logs. beta = 0 gives exactly the
    plain Trainer's loss (the reference is not even run). One process only.

    Args:
        ref_model (`torch.nn.Module`): the frozen reference pi_ref, a causal LM over the same vocabulary
            (typically a copy of the model before training); not the trained model itself.
        kl_beta (`float`): beta >= 0.
        *args, **kwargs: those of [`~transformers.Trainer`].

    ```python
    ref = copy.deepcopy(model)
    trainer = KLPenaltySFTTrainer(model=model, args=args, train_dataset=ds, ref_model=ref, kl_beta=0.1)
    ```
    """

    def __init__(self, *args: Any, ref_model: nn.Module | None = None, kl_beta: float = 0.0, **kwargs: Any):
        if ref_model is None:
            raise CFPArgumentError("KLPenaltySFTTrainer needs ref_model=, the frozen reference (e.g. a model copy).")
        if isinstance(kl_beta, bool) or not isinstance(kl_beta, (int, float)) or not 0 <= kl_beta < float("inf"):
            raise CFPArgumentError(f"kl_beta must be a finite number >= 0, got {kl_beta!r}.")
        super().__init__(*args, **kwargs)
        if ref_model is self.model:
            raise CFPArgumentError("ref_model is the model being trained: pass a frozen copy (copy.deepcopy(model)).")
        if self.args.world_size > 1:
            raise CFPArgumentError("KLPenaltySFTTrainer runs on one process; the KL term is not averaged across them.")
        self.ref_model = ref_model.to(self.args.device).eval()
        self.kl_beta = float(kl_beta)
        self._kl_means: list[float] = []  # KLbar of each training batch since the last log

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        """CE (the Trainer's own loss) + kl_beta * KLbar (class docstring)."""
        if self.kl_beta == 0:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        labels = inputs["labels"]  # read first: the Trainer may pop it from `inputs`
        with torch.no_grad():
            ref_logits = self.ref_model(**{k: v for k, v in inputs.items() if k != "labels"}).logits
        loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
        mask = labels[:, 1:] != IGNORE_INDEX
        log_p = nnf.log_softmax(outputs.logits[:, :-1].float(), dim=-1)[mask]
        log_ref = nnf.log_softmax(ref_logits[:, :-1].float(), dim=-1)[mask]
        kl_sum = (log_p.exp() * (log_p - log_ref)).sum()
        count = mask.sum().clamp(min=1)
        if self.model_accepts_loss_kwargs and num_items_in_batch is not None:
            count = num_items_in_batch  # the CE's own divisor: the labels of the whole accumulated batch
        kl = kl_sum / count
        if model.training:
            self._kl_means.append(float(kl_sum.detach()) / max(int(mask.sum()), 1))
        loss = loss + self.kl_beta * kl.to(loss.dtype)
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """The Trainer's log, plus `kl_penalty`: the mean KLbar of the training batches since the last log."""
        if "loss" in logs and self._kl_means:
            logs["kl_penalty"] = sum(self._kl_means) / len(self._kl_means)
            self._kl_means = []
        super().log(logs, start_time)
