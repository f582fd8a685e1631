"""Plain references for Kronecker factors: a per-sequence, per-token loop, and exact enumeration of every response.

Neither calls hf_cfp's scoring code. Each sequence x + y is one unpadded forward with hooks that keep every
Linear's input a_t and output; log mu(y|x) = sum_t log mu(y_t | position t - 1) with the sampler written out by
hand (`enumeration.ref_log_mu`), and g_t = d log mu(y|x) / d output_t by torch.autograd.grad. Then

    S_A = sum_{n,t} a a^T,   S_G = sum_{n,t} g g^T   over every position t of the sequence (prompt + response).
"""

import math

import torch
from torch import nn

from support.enumeration import all_responses, ref_log_mu


def sequence_outer_products(model, prompt, response, temperature=1.0, top_k=None):
    """({module name: sum_t a a^T}, {module name: sum_t g g^T}, log mu(y|x) as a float, positions) for one
    sequence, float64, over every nn.Linear of `model`; None when mu(y|x) = 0."""
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    handles = [
        m.register_forward_hook(lambda mod, args, out, name=name: seen.__setitem__(name, (args[0], out)))
        for name, m in linears.items()
    ]
    try:
        ids = torch.tensor([list(prompt) + list(response)])
        logits = model(input_ids=ids).logits[0]
    finally:
        for handle in handles:
            handle.remove()
    start = len(prompt)
    log_mu = sum(ref_log_mu(logits[start + t - 1], temperature, top_k)[y] for t, y in enumerate(response))
    if not math.isfinite(float(log_mu.detach())):  # holds a token the sampler never draws: probability 0
        return None
    outputs = [seen[name][1] for name in linears]
    grads = torch.autograd.grad(log_mu, outputs, allow_unused=True)
    a_sums, g_sums = {}, {}
    for (name, _), grad in zip(linears.items(), grads, strict=True):
        a = seen[name][0][0].detach().double()
        g = torch.zeros_like(seen[name][1][0]).double() if grad is None else grad[0].double()
        a_sums[name], g_sums[name] = a.T @ a, g.T @ g
    return a_sums, g_sums, float(log_mu.detach()), ids.shape[1]


def loop_factors(model, prompts, responses, temperature=1.0, top_k=None):
    """{module name: (A, G)} with A = S_A / T and G = S_G / N over the given sequences (the estimator on fixed
    samples), float64."""
    a_total: dict[str, torch.Tensor] = {}
    g_total: dict[str, torch.Tensor] = {}
    tokens = 0
    for prompt, response in zip(prompts, responses, strict=True):
        found = sequence_outer_products(model, prompt, response, temperature, top_k)
        assert found is not None, "a given response the sampler cannot draw"
        a_sums, g_sums, _, length = found
        tokens += length
        for name in a_sums:
            a_total[name] = a_total.get(name, 0) + a_sums[name]
            g_total[name] = g_total.get(name, 0) + g_sums[name]
    return {name: (a_total[name] / tokens, g_total[name] / len(prompts)) for name in a_total}


def exact_factors(model, prompts, temperature=1.0, top_k=None, eos=(), length=3):
    """{module name: (A, G)}, the limits of the estimator under the sampler: every response y of every prompt x
    weighted by mu(y|x) (prompts equally often),

        A = sum_x sum_y mu(y|x) S_A(x, y) / sum_x sum_y mu(y|x) L(x, y),    G = mean_x sum_y mu(y|x) S_G(x, y),

    with L the sequence's length (prompt + response), float64."""
    a_total: dict[str, torch.Tensor] = {}
    g_total: dict[str, torch.Tensor] = {}
    expected_tokens = 0.0
    for prompt in prompts:
        for response in all_responses(model.config.vocab_size, length, eos):
            found = sequence_outer_products(model, prompt, response, temperature, top_k)
            if found is None:  # holds a token the sampler never draws
                continue
            a_sums, g_sums, log_mu, positions = found
            weight = math.exp(log_mu)
            expected_tokens += weight * positions / len(prompts)
            for name in a_sums:
                a_total[name] = a_total.get(name, 0) + weight * a_sums[name] / len(prompts)
                g_total[name] = g_total.get(name, 0) + weight * g_sums[name] / len(prompts)
    return {name: (a_total[name] / expected_tokens, g_total[name]) for name in a_total}
