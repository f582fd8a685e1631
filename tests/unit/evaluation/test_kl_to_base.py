"""kl_to_base and KLToBaseCallback against exact enumeration of every response (tests/support/enumeration.py).

The enumeration model has a 6-token vocabulary, EOS = 3 and responses of at most T = 3 tokens, so every
response ends at EOS or is cut at 3 tokens; the exact KL sums over all of them (1 + 5 + 25 + 125 = 156 per
prompt) with a forward per prefix, without hf_cfp's sampling or scoring code.
"""

import copy
import math

import pytest
import torch
from support.enumeration import PROMPTS, T, enum_model, exact_kl, exact_log_ratio_moments, exact_quadratic_form
from support.extras import needs
from support.tensorboard import read_scalars
from support.tiny import tiny_llama, tiny_tokenizer
from support.training import lm_dataset
from transformers import Trainer, TrainingArguments

from hf_cfp import KLToBaseCallback, kl_to_base
from hf_cfp.errors import CFPArgumentError
from hf_cfp.evaluation import kl_estimate, kl_to_base_with_stderr

EOS = 3
KEY, STDERR_KEY = "cfp/math/kl_to_base", "cfp/math/kl_to_base_stderr"


def displaced(base, eps, seed=1):
    """(theta0 + eps * v, v) with v ~ N(0, 1) per coordinate, in the base's dtype."""
    generator = torch.Generator().manual_seed(seed)
    direction = {n: torch.randn(p.shape, generator=generator, dtype=p.dtype) for n, p in base.named_parameters()}
    model = copy.deepcopy(base)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.add_(eps * direction[n])
    return model, direction


def test_kl_estimate_is_the_mean_with_the_within_prompt_standard_error():
    """A plain loop: KL_hat = mean of d, stderr = sqrt(sum_p s_p^2 / m) / P (s_p^2 with m - 1); m = 1 falls
    back to the spread of all d about the mean, / sqrt(P)."""
    d = [[0.5, 1.5, 4.0], [-1.0, 2.0, 2.0]]  # P = 2 prompts, m = 3
    base = torch.tensor([x for row in d for x in row], dtype=torch.float64) + 7.0
    estimate = kl_estimate(base, torch.full((6,), 7.0, dtype=torch.float64), 3)
    means = [sum(row) / 3 for row in d]
    variances = [sum((x - mu) ** 2 for x in row) / 2 for row, mu in zip(d, means, strict=True)]
    assert estimate.kl == pytest.approx(sum(means) / 2, abs=1e-12)
    assert estimate.stderr == pytest.approx(math.sqrt(sum(variances) / 3) / 2, abs=1e-12)
    assert (estimate.num_prompts, estimate.num_samples_per_prompt) == (2, 3)

    single = kl_estimate(torch.tensor([1.0, 2.0, 6.0], dtype=torch.float64), torch.zeros(3, dtype=torch.float64), 1)
    assert single.kl == pytest.approx(3.0) and single.stderr == pytest.approx(math.sqrt(7.0) / math.sqrt(3))


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_kl_to_base_matches_exact_enumeration(temperature):
    """theta = theta0 + 0.3 v; m = 1024 responses on each of the 2 prompts (stderr about 1.6% of the KL at
    T = 1, 3% at T = 2). Exact KL 4.058 at T = 1; at T = 2 the tempered policies are compared (both scored at
    T = 2), exact 1.023. The estimate lies within 3 exact stderr, and its reported stderr within 25% of the
    exact one, sqrt(sum_p Var_p / m) / P from the enumerated variances. What a wrong estimator would give lies
    many stderr away: the reverse KL(mu_theta || mu_0) = 3.424 at T = 1 (~10 stderr), the untempered KL 4.058
    at T = 2 (~100 stderr)."""
    base = enum_model(eos_token_id=EOS)
    model, _ = displaced(base, 0.3)
    m = 1024
    estimate = kl_to_base_with_stderr(
        base, model, None, PROMPTS, num_samples_per_prompt=m, max_new_tokens=T, temperature=temperature, batch_size=512
    )
    moments = exact_log_ratio_moments(base, model, PROMPTS, temperature, eos={EOS})
    exact = sum(kl for kl, _ in moments) / len(PROMPTS)
    exact_stderr = math.sqrt(sum(var for _, var in moments) / m) / len(PROMPTS)
    assert abs(estimate.kl - exact) < 3 * exact_stderr, (estimate, exact, exact_stderr)
    assert 0.8 < estimate.stderr / exact_stderr < 1.25, (estimate.stderr, exact_stderr)
    if temperature == 1.0:
        wrong = exact_kl(model, base, PROMPTS, temperature, eos={EOS})  # the reverse KL
    else:
        wrong = exact_kl(base, model, PROMPTS, 1.0, eos={EOS})  # the untempered KL
    assert abs(estimate.kl - wrong) > 6 * exact_stderr, (estimate.kl, wrong, exact_stderr)
    # the float entry point is the same estimate
    assert kl_to_base(base, model, None, PROMPTS, m, T, temperature, batch_size=512) == estimate.kl


def test_kl_matches_half_the_fisher_quadratic_form_for_small_displacements():
    """KL(mu_0 || mu_theta) = 0.5 Delta^T F Delta + O(|Delta|^3), F the full sequence Fisher E[g g^T] (exact,
    enumerated), Delta = eps v. Float64 models, both sides exact. Measured ratio KL / (0.5 Delta^T F Delta):
    1.0542 at eps = 0.01, 1.0157 at eps = 0.003 (1.0052 at eps = 0.001): ratio - 1 is about 5.3 eps, the
    third-order term. (With the diagonal F that CFP uses, the float32 model gave 1.088 at eps = 0.01 against
    1.069 for the full F on its direction: the off-diagonal part is small on a random direction here.)"""
    base = enum_model(eos_token_id=EOS).double()
    _, direction = displaced(base, 0.0)
    quadratic = exact_quadratic_form(base, PROMPTS, direction, eos={EOS})  # v^T F v; Delta^T F Delta = eps^2 of it
    ratios = {}
    for eps in (0.01, 0.003):
        model, _ = displaced(base, eps)
        ratios[eps] = exact_kl(base, model, PROMPTS, eos={EOS}) / (0.5 * eps**2 * quadratic)
    assert ratios[0.01] == pytest.approx(1.054, abs=0.01), ratios
    assert ratios[0.003] == pytest.approx(1.016, abs=0.005), ratios
    assert (ratios[0.01] - 1) / (ratios[0.003] - 1) == pytest.approx(0.01 / 0.003, rel=0.1)  # the O(eps) term


def test_kl_to_base_of_the_base_is_exactly_zero():
    """Text prompts through the chat template, a copy of the base as the model: every log-ratio is 0.0."""
    tokenizer = tiny_tokenizer()
    base = tiny_llama(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    prompts = ["what is two plus three", "print the sum"]
    kwargs = {"num_samples_per_prompt": 3, "max_new_tokens": 6, "batch_size": 4}
    estimate = kl_to_base_with_stderr(base, copy.deepcopy(base), tokenizer, prompts, **kwargs)
    assert (estimate.kl, estimate.stderr) == (0.0, 0.0)
    assert kl_to_base(base, base, tokenizer, prompts, **kwargs) == 0.0


def test_bad_arguments_are_refused():
    base = enum_model(eos_token_id=EOS)
    with pytest.raises(CFPArgumentError, match="num_samples_per_prompt"):
        kl_to_base(base, base, None, PROMPTS, num_samples_per_prompt=0)
    with pytest.raises(CFPArgumentError, match="temperature"):
        kl_to_base(base, base, None, PROMPTS, temperature=0.0)
    with pytest.raises(CFPArgumentError, match="name"):
        KLToBaseCallback(None, PROMPTS, name="")


CALLBACK_PROMPTS = [[1, 2, 3], [4, 6, 7, 8]]
CALLBACK_KWARGS = {"num_samples_per_prompt": 4, "max_new_tokens": 5, "seed": 3, "batch_size": 4}


def _train(model, callback, tmp_path, report_to="none", steps=4):
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=steps,
        per_device_train_batch_size=4,
        learning_rate=3e-2,
        use_cpu=True,
        report_to=report_to,
        logging_steps=2,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=lm_dataset(), callbacks=[callback])
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h]


def test_callback_logs_kl_at_logging_steps_equal_to_kl_to_base(tmp_path, monkeypatch):
    """A 4-step Trainer run logging every 2 steps: both keys in every loss log and in TensorBoard at the loss
    steps; the last value equals kl_to_base(copy of the initial model, trained model) with the same seed
    (same responses), and it is positive (the model moved)."""
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    model = tiny_llama(vocab_size=32, eos_token_id=5)
    base = copy.deepcopy(model)
    callback = KLToBaseCallback(None, CALLBACK_PROMPTS, name="math", **CALLBACK_KWARGS)
    logs = _train(model, callback, tmp_path, report_to=["tensorboard"])
    assert [h["step"] for h in logs] == [2, 4]
    reference = kl_to_base_with_stderr(base, model, None, CALLBACK_PROMPTS, **CALLBACK_KWARGS)
    assert logs[-1][KEY] == pytest.approx(reference.kl, abs=1e-12) and reference.kl > 0.01
    assert logs[-1][STDERR_KEY] == pytest.approx(reference.stderr, abs=1e-12)
    scalars = read_scalars(tmp_path / "tb")
    for key in (KEY, STDERR_KEY):
        assert [s for s, _ in scalars[f"train/{key}"]] == [2, 4]
        for (_, value), h in zip(scalars[f"train/{key}"], logs, strict=True):
            assert value == pytest.approx(h[key], rel=1e-6)  # TensorBoard stores float32


def test_callback_on_a_peft_model_measures_from_the_model_at_train_begin(tmp_path):
    """LoRA (B = 0 at init): the base responses drawn from the PeftModel at train begin are those of the plain
    base model, so the logged KL equals kl_to_base(plain base, trained PeftModel). (The adapter moves little
    in 4 steps: the 8-response estimate is then of the order of its stderr, of either sign.)"""
    needs("peft")
    from peft import LoraConfig, get_peft_model

    plain = tiny_llama(vocab_size=32, eos_token_id=5)
    base = copy.deepcopy(plain)
    model = get_peft_model(plain, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    callback = KLToBaseCallback(None, CALLBACK_PROMPTS, name="math", **CALLBACK_KWARGS)
    logs = _train(model, callback, tmp_path)
    reference = kl_to_base_with_stderr(base, model, None, CALLBACK_PROMPTS, **CALLBACK_KWARGS)
    assert logs[-1][KEY] == pytest.approx(reference.kl, abs=1e-12) and reference.kl != 0.0  # the adapter moved
    assert callback.base is not None and len(callback.base.responses) == 8
