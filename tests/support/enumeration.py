"""Exact enumeration on a tiny model: every response of a Llama with a 6-token vocabulary, plain forwards.

The exact Fisher here never calls hf_cfp's scoring code: a prefix tree of plain forwards, the
sampler distribution written out by hand, per-response scores from torch.autograd.grad. With the
comparisons the estimator tests use on it (`flat`, `mass_ratio`, `pearson`).
"""

import math

import pytest
import torch

from support.tiny import tiny_llama

V = 6  # vocabulary of the enumeration model
T = 3  # response length (fixed when there is no EOS)
PROMPTS = [[1, 4, 2], [5, 0]]  # different lengths: sampling left-pads them in one batch


def enum_model(**overrides):
    # initializer_range 0.3: clearly non-uniform next-token distributions (0.10-0.27 on the first
    # prompt) with the lightest per-sequence score tails among the tiny configurations measured.
    return tiny_llama(vocab_size=V, hidden_size=8, layers=1, initializer_range=0.3, **overrides)


def ref_log_mu(logits_row, temperature=1.0, top_k=None):
    """log of the sampler's next-token distribution, written out: z / tau, keep the k largest
    (ranked in Python, the mask carries no gradient), renormalize. Float64."""
    z = logits_row.double() / temperature
    if top_k is not None:
        values = z.detach().tolist()
        ranked = sorted(range(len(values)), key=lambda a: values[a], reverse=True)
        keep = torch.zeros(len(values), dtype=torch.bool)
        keep[ranked[:top_k]] = True
        z = z.masked_fill(~keep, float("-inf"))
    return z - torch.logsumexp(z, dim=0)


def all_responses(vocab, length, eos=()):
    """Every complete response: it ends at its first EOS or after `length` tokens."""
    out = []

    def grow(prefix):
        if len(prefix) == length or (prefix and prefix[-1] in eos):
            out.append(tuple(prefix))
            return
        for a in range(vocab):
            grow(prefix + [a])

    grow([])
    return out


def response_log_probs(model, prompt, temperature=1.0, top_k=None, eos=(), length=T):
    """{y: log mu(y|x)} for every complete response y (`all_responses`), with autograd graphs.

    log mu(y|x) = sum_t log mu(y_t | x, y_<t), each conditional from its own forward of the
    prefix x + y_<t (no teacher forcing, no cache, no padding), float64.
    """
    nodes = {}

    def log_mu(prefix):
        if prefix not in nodes:
            logits = model(input_ids=torch.tensor([list(prompt) + list(prefix)])).logits[0, -1]
            nodes[prefix] = ref_log_mu(logits, temperature, top_k)
        return nodes[prefix]

    return {
        y: sum(log_mu(y[:t])[y[t]] for t in range(len(y))) for y in all_responses(model.config.vocab_size, length, eos)
    }


def exact_fisher(model, prompts, temperature=1.0, top_k=None, eos=(), length=T):
    """F = mean_x sum_y mu(y|x) g(y)^2, g = d/dtheta log mu(y|x), by enumerating every response
    (`response_log_probs`). Returns {name: float64 tensor}, and checks that mu sums to 1 and that
    the score is centered (sum_y mu g = 0) for every prompt.
    """
    named = list(model.named_parameters())
    params = [p for _, p in named]
    fisher = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    for prompt in prompts:
        total_prob = 0.0
        mean_score = [torch.zeros_like(f) for f in fisher]
        for log_prob in response_log_probs(model, prompt, temperature, top_k, eos, length).values():
            prob = math.exp(float(log_prob.detach()))
            total_prob += prob
            if prob == 0.0:  # contains a truncated token: never drawn
                continue
            grads = torch.autograd.grad(log_prob, params, retain_graph=True, allow_unused=True)
            for f, m, g in zip(fisher, mean_score, grads, strict=True):
                if g is not None:
                    f.add_(prob * g.double() ** 2 / len(prompts))
                    m.add_(prob * g.double())
        assert total_prob == pytest.approx(1.0, abs=1e-9)
        flat_mean = torch.cat([m.flatten() for m in mean_score])
        assert float(flat_mean.abs().max()) < 1e-5 * max(1.0, float(torch.cat([f.flatten() for f in fisher]).max()))
    return {name: f for (name, _), f in zip(named, fisher, strict=True)}


@torch.no_grad()
def exact_log_ratio_moments(base, model, prompts, temperature=1.0, eos=(), length=T):
    """[(KL_x, Var_x)] per prompt: the mean and variance under y ~ mu_0(.|x) of
    d(y) = log mu_0(y|x) - log mu_theta(y|x), over every complete response (a response cut at
    `length` tokens is the event "its first `length` tokens are y"), both at `temperature`.
    KL_x = sum_y mu_0(y|x) d(y) is the exact sequence KL(mu_0(.|x) || mu_theta(.|x)).
    Checks that mu_0 and mu_theta each sum to 1 over the responses."""
    moments = []
    for prompt in prompts:
        log_p0 = response_log_probs(base, prompt, temperature, None, eos, length)
        log_p = response_log_probs(model, prompt, temperature, None, eos, length)
        p0 = torch.stack(list(log_p0.values())).exp()
        assert float(p0.sum()) == pytest.approx(1.0, abs=1e-9)
        assert float(torch.stack(list(log_p.values())).exp().sum()) == pytest.approx(1.0, abs=1e-9)
        d = torch.stack([log_p0[y] - log_p[y] for y in log_p0])
        mean = float((p0 * d).sum())
        moments.append((mean, float((p0 * (d - mean) ** 2).sum())))
    return moments


def exact_kl(base, model, prompts, temperature=1.0, eos=(), length=T):
    """mean_x KL(mu_0(.|x) || mu_theta(.|x)), exact (`exact_log_ratio_moments`)."""
    moments = exact_log_ratio_moments(base, model, prompts, temperature, eos, length)
    return sum(kl for kl, _ in moments) / len(moments)


def exact_quadratic_form(model, prompts, delta, temperature=1.0, eos=(), length=T):
    """Delta^T F Delta = mean_x sum_y mu(y|x) (g(y) . Delta)^2 with the full (not diagonal) sequence
    Fisher F = mean_x E_y[g g^T], g = d/dtheta log mu(y|x), by enumeration. `delta`: {name: tensor}."""
    named = list(model.named_parameters())
    params = [p for _, p in named]
    total = 0.0
    for prompt in prompts:
        for log_prob in response_log_probs(model, prompt, temperature, None, eos, length).values():
            grads = torch.autograd.grad(log_prob, params, retain_graph=True, allow_unused=True)
            directional = sum(
                float((g.double() * delta[n].double()).sum())
                for (n, _), g in zip(named, grads, strict=True)
                if g is not None
            )
            total += math.exp(float(log_prob.detach())) * directional**2 / len(prompts)
    return total


def flat(fisher, model):
    """Concatenate in the model's parameter order (accepts a FisherAnchor or a dict)."""
    tensors = getattr(fisher, "fisher", fisher)
    return torch.cat([tensors[n].double().flatten() for n, _ in model.named_parameters()])


def mass_ratio(estimate, reference):
    return float(estimate.sum() / reference.sum())


def pearson(a, b):
    return float(torch.corrcoef(torch.stack([a, b]))[0, 1])
