"""The long run's baselines against plain references: the LwF term equals KL(p0 || p_theta) summed over every
response position and vocabulary entry in float64, sequence by sequence (value and gradient), is 0 at the base
weights and walks the calibration sequences in turn; WiSE-FT is theta0 + a (theta_T - theta0); LoRA wraps the
projections only."""

import copy

import torch
from support.extras import needs, requires

needs("trl", "datasets")

from evidence.run import tiny_model_and_tokenizer  # noqa: E402
from longrun.baselines import Distillation, lora_model, wise_ft  # noqa: E402

from hf_cfp.loading.prompts import calibration_prompts  # noqa: E402


def perturbed(model, scale=0.05, seed=1):
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return other


def reference_kl(base, model, ids, prompt_length, response_length):
    """sum over the response's positions t and tokens v of p0_v (log p0_v - log p_v), float64, one sequence."""
    row = ids[: prompt_length + response_length].unsqueeze(0)
    log_p0 = torch.log_softmax(base.double()(row).logits[0].double(), -1)
    log_p = torch.log_softmax(model.double()(row).logits[0].double(), -1)
    total = torch.zeros((), dtype=torch.float64)
    for t in range(prompt_length - 1, prompt_length + response_length - 1):
        for v in range(log_p0.shape[-1]):
            total = total + log_p0[t, v].exp() * (log_p0[t, v] - log_p[t, v])
    return total


def test_distillation_is_the_full_vocabulary_kl_on_the_anchor_sequences_in_turn():
    base, tokenizer = tiny_model_and_tokenizer()
    base.eval()
    distillation = Distillation(base, tokenizer, calibration_prompts("math")[:3], 4, 5, batch_size=2)
    assert float(distillation.kl(base)) < 1e-6  # the base model against itself
    model = perturbed(base)
    reference_model = copy.deepcopy(model)  # no gradients yet
    value = distillation.kl(model)  # sequences 2, 3 (the first call took 0, 1)
    value.backward()
    sums, count = torch.zeros((), dtype=torch.float64), 0
    for n in (2, 3):
        response = len(distillation.positions[n])
        prompt = int(distillation.attention_mask[n].sum()) - response
        sums = sums + reference_kl(copy.deepcopy(base), reference_model, distillation.input_ids[n], prompt, response)
        count += response
    expected = sums / count
    torch.testing.assert_close(value.double(), expected, rtol=1e-4, atol=1e-7)
    expected.backward()
    for (name, got), (_, want) in zip(model.named_parameters(), reference_model.named_parameters(), strict=True):
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=1e-3, atol=1e-7, msg=name)
    assert distillation.next == 0  # four sequences, two per call: back to the first


def test_wise_ft_interpolates_every_trained_parameter():
    base, _ = tiny_model_and_tokenizer()
    trained = {n: p.detach().clone() for n, p in perturbed(base, scale=0.3).named_parameters()}
    mixed = wise_ft(base, trained, 0.25)
    for (name, got), (_, theta0) in zip(mixed.named_parameters(), base.named_parameters(), strict=True):
        torch.testing.assert_close(got, theta0 + 0.25 * (trained[name] - theta0), rtol=1e-6, atol=1e-7)


@requires("peft")
def test_lora_wraps_the_projections_only():
    base, _ = tiny_model_and_tokenizer()
    wrapped = lora_model(copy.deepcopy(base), 4)
    adapted = {n.split(".")[-4] for n, p in wrapped.named_parameters() if p.requires_grad}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert all("lora_" in n for n, p in wrapped.named_parameters() if p.requires_grad)
