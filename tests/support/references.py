"""Plain reference implementations the library is compared against (none calls hf_cfp's own math)."""

import math

import pytest
import torch
from transformers import TrainerCallback


class ReferenceCFP(TrainerCallback):
    """The formula, one parameter and one expression at a time: theta0 + (theta - theta0) / (1 + lam F)."""

    def __init__(self, fisher, lam):
        self.fisher, self.lam = fisher, lam

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.theta0 = {n: p.detach().clone() for n, p in model.named_parameters()}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        lam = self.lam(state.global_step) if callable(self.lam) else self.lam
        with torch.no_grad():
            for n, p in model.named_parameters():
                t0 = self.theta0[n]
                p.copy_(t0 + (p - t0) / (1 + lam * self.fisher[n]))


def ref_sequence_score(model, prompt, response):
    """(d/dtheta log pi(response | prompt)) for temperature 1, one plain forward, float64 log-softmax; one
    float64 tensor per `model.named_parameters()` entry."""
    params = [p for _, p in model.named_parameters()]
    ids = torch.tensor([prompt + response])
    logits = model(input_ids=ids).logits[0].double()
    log_prob = sum(logits[len(prompt) - 1 + t].log_softmax(0)[tok] for t, tok in enumerate(response))
    return [g.double() for g in torch.autograd.grad(log_prob, params)]


def py_sampler_probs(row, temperature, top_k, top_p):
    """Plain Python: z/tau; keep the top_k largest; softmax; keep the smallest top set whose
    cumulative probability reaches top_p; renormalize."""
    z = [v / temperature for v in row]
    order = sorted(range(len(z)), key=lambda a: z[a], reverse=True)
    if top_k is not None:
        order = order[:top_k]
    peak = max(z[a] for a in order)
    weights = {a: math.exp(z[a] - peak) for a in order}
    total = sum(weights.values())
    probs = {a: w / total for a, w in weights.items()}
    kept, cumulative = [], 0.0
    for a in order:
        kept.append(a)
        cumulative += probs[a]
        if cumulative >= top_p:
            break
    mass = sum(probs[a] for a in kept)
    return [probs[a] / mass if a in kept else 0.0 for a in range(len(z))]


def drift_reference(deltas, fisher, name, free_fraction=0.99):
    """The drift metrics in float64, one expression each, of displacements `deltas` (weight name -> tensor)
    under `fisher` (weight name -> F): sqrt(sum F d^2), ||d|| where F <= the k-th smallest F over these
    weights (k = ceil(free_fraction n)), ||d||, and the predicted KL sum F d^2 / 2."""
    deltas = {n: d.double() for n, d in deltas.items()}
    fisher = {n: fisher[n].double() for n in deltas}
    flat = torch.cat([f.reshape(-1) for f in fisher.values()])
    threshold = torch.kthvalue(flat, math.ceil(free_fraction * flat.numel())).values
    sensitive_sq = sum(float((fisher[n] * d**2).sum()) for n, d in deltas.items())
    return {
        f"cfp/{name}/sensitive_drift": math.sqrt(sensitive_sq),
        f"cfp/{name}/predicted_kl": sensitive_sq / 2,
        f"cfp/{name}/free_drift": math.sqrt(
            sum(float(d[fisher[n] <= threshold].square().sum()) for n, d in deltas.items())
        ),
        "cfp/total_drift": math.sqrt(sum(float(d.square().sum()) for d in deltas.values())),
    }


def assert_metrics_match(measured, reference, rel=1e-6):
    """The same drift keys (`cfp/<anchor>/lam`, the strength used, is not one), every reference value > 0, and
    each measured value within `rel` of it."""
    measured = {k: v for k, v in measured.items() if not k.endswith("/lam")}
    assert measured.keys() == reference.keys()
    for key, value in reference.items():
        assert value > 0, key
        assert measured[key] == pytest.approx(value, rel=rel), (key, measured[key], value)


@torch.no_grad()
def train_a_little(model, seed=0, scale=0.05):
    """Stand-in for optimizer steps: every trainable parameter moves by scale * N(0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        if p.requires_grad:
            p.add_(scale * torch.randn(p.shape, generator=gen).to(p.device))


class StepReference(TrainerCallback):
    """Checks every step's correction against the formula in float64, applied to the proposal the
    optimizer actually made in this run (so CPU-dependent bf16 kernels change the proposal, not the
    check). Runs after CFPCallback's on_step_end. The model may be on any device: the check runs on float64
    CPU copies. `fisher` is the F the correction should apply (zero where a coordinate is left uncorrected).

    Bound per element, from the formats alone: CFP computes lerp(p, t0, w) in float32 (w rounded
    once, the lerp a few roundings of magnitude |p| + |t0|), then casts to the parameter dtype once:
    |got - expected| <= ulp_dtype(expected) + 4 eps32 (|p| + |t0|), with eps32 = 2^-23."""

    EPS32 = torch.finfo(torch.float32).eps

    def __init__(self, fisher, lam):
        self.fisher, self.lam = fisher, lam
        self.steps = self.violations = self.exact = self.checked = 0
        self.largest_gap_over_bound = 0.0

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.theta0 = {n: p.detach().double().cpu() for n, p in model.named_parameters()}

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.proposal = {n: p.detach().double().cpu() for n, p in model.named_parameters()}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.steps += 1
        for n, p in model.named_parameters():
            t0, proposal = self.theta0[n], self.proposal[n]
            exact = t0 + (proposal - t0) / (1 + self.lam * self.fisher[n].double())
            expected = exact.to(p.dtype).double()
            ulp = torch.finfo(p.dtype).eps * expected.abs().clamp_min(torch.finfo(p.dtype).tiny)
            bound = ulp + 4 * self.EPS32 * (proposal.abs() + t0.abs())
            got = p.detach().double().cpu()
            gap = (got - expected).abs()
            self.violations += int((gap > bound).sum())
            self.largest_gap_over_bound = max(self.largest_gap_over_bound, float((gap / bound).max()))
            self.exact += int(torch.equal(got, expected))
            self.checked += 1
