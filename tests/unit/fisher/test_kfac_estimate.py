"""estimate_fisher(structure="kfac") against plain references: a per-sequence, per-token loop of a a^T and g g^T on
the same sequences (both engines), and exact enumeration of every response under the sampler (temperature 1,
tempered, top-k). The references (`support.kfac_reference`) never call hf_cfp's scoring code.

Monte Carlo tolerances: the exact factors are expectations; with 4000 sequences the largest relative Frobenius
error over the Linear weights of the enumeration model measured 0.3-1.1% for A and 2.9-4.5% for G (seeds 0-2, each
sampler), so the tolerances 5% (A) and 10% (G) are about twice the noise, while the exact G of the three samplers
differ from one another by 43-103% (`test_exact_factors_tell_the_samplers_apart`)."""

import pytest
import torch
from support.enumeration import PROMPTS, T, enum_model
from support.kfac_reference import exact_factors, loop_factors
from support.tiny import tiny_llama

from hf_cfp import estimate_fisher
from hf_cfp.errors import CFPArgumentError
from hf_cfp.fisher.module_kinds import layer_kind as kfac_kind
from hf_cfp.geometry.kronecker import factors as kfac_factors


def linear_weights(model):
    """module name -> weight name of every nn.Linear the estimate factors."""
    return {n: f"{n}.weight" for n, m in model.named_modules() if kfac_kind(m) is not None}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


@pytest.mark.parametrize("engine", ["batched", "loop"])
def test_factors_on_given_sequences_equal_the_per_token_loop(engine):
    """On fixed sequences (the empirical estimator scores the given responses under mu = pi): A = S_A / T and
    G = S_G / N with T every prompt and response position, for every Linear; the rest of the anchor is the
    diagonal F."""
    model = tiny_llama(vocab_size=40, hidden_size=16, layers=2, seed=3)
    prompts = [[1, 4, 2, 7], [5, 9], [3, 3, 8]]
    responses = [[6, 2, 11], [7], [1, 2, 3, 4, 5]]
    anchor = estimate_fisher(
        model,
        None,
        prompts,
        num_sequences=3,
        batch_size=3,
        estimator="empirical",
        responses=responses,
        engine=engine,
        structure="kfac",
        show_progress=False,
    )
    reference = loop_factors(model, prompts, responses)
    weights = linear_weights(model)
    assert anchor.structure == "kfac"
    assert sorted(anchor.kfac_names) == sorted(weights.values())
    assert not set(anchor.kfac_names) & set(anchor.fisher)  # the factored weights keep no diagonal F
    assert "model.embed_tokens.weight" in anchor.fisher and "model.norm.weight" in anchor.fisher
    for module, weight in weights.items():
        a, g = anchor.kfac_factors(weight)
        want_a, want_g = reference[module]
        assert torch.allclose(a.double(), want_a, rtol=1e-4, atol=1e-6 * float(want_a.abs().max())), weight
        assert torch.allclose(g.double(), want_g, rtol=1e-4, atol=1e-5 * float(want_g.abs().max())), weight
    assert anchor.metadata["num_tokens"] == sum(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))


def test_diagonal_part_is_the_diagonal_estimate_bit_for_bit():
    model = tiny_llama(vocab_size=40, hidden_size=16, layers=1, seed=1)
    common = dict(num_sequences=6, max_new_tokens=4, batch_size=3, seed=2, show_progress=False)
    diagonal = estimate_fisher(model, None, [[1, 2, 3], [4, 5]], **common)
    kfac = estimate_fisher(model, None, [[1, 2, 3], [4, 5]], structure="kfac", **common)
    for name, tensor in kfac.fisher.items():
        assert torch.equal(tensor, diagonal.fisher[name]), name
    assert diagonal.structure == "diagonal" and diagonal.kfac_names == []


@pytest.mark.parametrize("sampler", [{}, {"temperature": 0.7}, {"top_k": 3}])
def test_factors_match_exact_enumeration_under_the_sampler(sampler):
    model = enum_model()
    anchor = estimate_fisher(
        model,
        None,
        PROMPTS,
        num_sequences=4000,
        max_new_tokens=T,
        batch_size=64,
        seed=0,
        show_progress=False,
        structure="kfac",
        **sampler,
    )
    exact = exact_factors(model, PROMPTS, temperature=sampler.get("temperature", 1.0), top_k=sampler.get("top_k"))
    for module, weight in linear_weights(model).items():
        a, g = anchor.kfac_factors(weight)
        assert relative_error(a, exact[module][0]) < 0.05, (weight, "A")
        assert relative_error(g, exact[module][1]) < 0.10, (weight, "G")


def test_exact_factors_tell_the_samplers_apart():
    """The check above has teeth: the tempered and the truncated sampler's exact G differ from temperature 1's by
    over three times the tolerance on every weight."""
    model = enum_model()
    plain = exact_factors(model, PROMPTS)
    for other in (exact_factors(model, PROMPTS, temperature=0.7), exact_factors(model, PROMPTS, top_k=3)):
        assert min(relative_error(other[m][1].float(), plain[m][1]) for m in plain) > 0.3


def test_truncated_bases_keep_the_top_eigenpairs():
    model = tiny_llama(vocab_size=40, hidden_size=16, layers=1, seed=4)
    common = dict(num_sequences=8, max_new_tokens=5, batch_size=4, seed=0, show_progress=False, structure="kfac")
    full = estimate_fisher(model, None, [[1, 2, 3]], **common)
    top = estimate_fisher(model, None, [[1, 2, 3]], kfac_rank=3, **common)
    name = full.kfac_names[0]
    a, _ = full.kfac_factors(name)
    values, vectors = torch.linalg.eigh(a.double())
    best = vectors[:, -3:] @ torch.diag(values[-3:]) @ vectors[:, -3:].T
    rest = values[:-3].mean()  # the tail: the mean of the eigenvalues left out
    eye = torch.eye(len(values), dtype=torch.float64)
    best += rest * (eye - vectors[:, -3:] @ vectors[:, -3:].T)
    assert top.kfac[name].a_vectors.shape[1] == 3
    assert float(top.kfac[name].a_tail) == pytest.approx(float(rest), rel=1e-4)
    assert torch.allclose(top.kfac_factors(name)[0].double(), best, atol=1e-5 * float(values[-1]))
    assert float(top.kfac_factors(name)[0].double().trace()) == pytest.approx(float(a.double().trace()), rel=1e-5)
    assert top.metadata["kfac_rank"] == 3


def test_layers_of_any_width_are_factored():
    head = torch.nn.Linear(8, 200_000, bias=False, device="meta")  # wider than any vocabulary
    assert kfac_kind(head) == "linear" and kfac_kind(torch.nn.Linear(8, 4)) == "linear"


def principal_sines(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The sines of the principal angles between the column spans of u and v (orthonormal columns)."""
    cosines = torch.linalg.svdvals(u.double().T @ v.double()).clamp(max=1)
    return (1 - cosines.square()).sqrt()


def test_sketched_factors_agree_with_formed_ones(monkeypatch):
    """The same estimate with every factor formed, and with factors wider than 40 sketched (the MLP's 64-wide
    factors): the top-4 eigenvalues within 1%, principal angles of the top-2 subspaces
    small, each factor's trace (kept eigenvalues plus the tail over the rest) equal to float32 precision, and so the
    tails within 1%."""
    model = tiny_llama(vocab_size=32, hidden_size=32, layers=1, seed=7)
    common = dict(num_sequences=24, max_new_tokens=6, batch_size=8, seed=0, show_progress=False, structure="kfac")
    formed = estimate_fisher(model, None, [[1, 2, 3], [4, 5, 6, 7]], kfac_rank=4, **common)
    monkeypatch.setattr(kfac_factors, "MAX_FORMED_DIMENSION", 40)
    sketched = estimate_fisher(model, None, [[1, 2, 3], [4, 5, 6, 7]], kfac_rank=4, **common)
    wide = 0
    for name in formed.kfac_names:
        for which in ("a", "g"):
            formed_part, sketched_part = (
                [getattr(anchor.kfac[name], f"{which}_{part}") for part in ("values", "vectors", "tail")]
                for anchor in (formed, sketched)
            )
            (f_values, f_vectors, f_tail), (s_values, s_vectors, s_tail) = formed_part, sketched_part
            wide += f_vectors.shape[0] > 40
            assert torch.allclose(s_values, f_values, rtol=1e-2), (name, which)
            assert float(principal_sines(s_vectors[:, :2], f_vectors[:, :2]).max()) < 0.05, (name, which)
            dim = f_vectors.shape[0]
            f_trace, s_trace = (
                float(v.double().sum()) + float(t) * (dim - 4) for v, t in ((f_values, f_tail), (s_values, s_tail))
            )
            assert s_trace == pytest.approx(f_trace, rel=1e-5), (name, which)  # the exact trace, kept
            assert float(s_tail) == pytest.approx(float(f_tail), rel=1e-2), (name, which)
    assert wide == 3  # gate_proj's and up_proj's G, down_proj's A were sketched


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"structure": "blocks"}, "structure must be one of"),
        ({"structure": "kfac", "kfac_rank": 0}, "kfac_rank must be"),
        ({"kfac_rank": 4}, "kfac_rank applies to structure='kfac' only"),
        ({"structure": "kfac", "estimator": "token"}, "token estimator"),
    ],
)
def test_bad_structure_arguments_raise(kwargs, words):
    model = tiny_llama(vocab_size=40, hidden_size=16, layers=1)
    with pytest.raises(CFPArgumentError, match=words):
        estimate_fisher(model, None, [[1, 2]], num_sequences=2, max_new_tokens=2, show_progress=False, **kwargs)
