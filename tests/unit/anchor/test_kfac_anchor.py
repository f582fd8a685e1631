"""K-FAC anchors as artifacts: built from factors, saved and loaded (eagerly, lazily, sharded, bf16), combined as the
pooled estimate, compared, carded, and refused when broken."""

import json

import pytest
import torch
from support.tiny import tiny_llama

from hf_cfp import FisherAnchor, estimate_fisher
from hf_cfp.anchor.card import render_card
from hf_cfp.anchor.compare import compare_anchors
from hf_cfp.errors import AnchorMismatchError, AnchorValidationError, CFPArgumentError
from hf_cfp.geometry.diagonal.artifact import LazyFisher


def psd(n: int, seed: int) -> torch.Tensor:
    x = torch.randn(n, n + 2, generator=torch.Generator().manual_seed(seed))
    return x @ x.T / n


def small_kfac_anchor(name="math", seed=0) -> FisherAnchor:
    return FisherAnchor(
        {"norm.weight": torch.rand(4, generator=torch.Generator().manual_seed(seed))},
        name=name,
        metadata={"base_model": "org/base", "num_tokens": 10.0},
        kfac={
            "proj.weight": (psd(4, seed + 1), psd(3, seed + 2)),
            "head.weight": (psd(3, seed + 3), psd(5, seed + 4)),
        },
    )


@pytest.mark.parametrize("options", [{}, {"max_shard_size": 60}, {"dtype": "bfloat16"}])
def test_round_trip_keeps_the_factors_and_the_lazy_anchor_reads_the_same(tmp_path, options):
    anchor = small_kfac_anchor()
    anchor.save_pretrained(tmp_path, **options)
    tolerance = 1e-6 if "dtype" not in options else 2e-2  # bf16 on disk rounds the eigenbases
    for lazy in (False, True):
        back = FisherAnchor.from_pretrained(tmp_path, lazy=lazy)
        assert back.structure == "kfac" and sorted(back.kfac_names) == ["head.weight", "proj.weight"]
        assert list(back.fisher) == ["norm.weight"] and isinstance(back.fisher, LazyFisher) == lazy
        for name in anchor.kfac_names:
            for got, want in zip(back.kfac_factors(name), anchor.kfac_factors(name), strict=True):
                assert torch.allclose(got, want, atol=tolerance * float(want.abs().max())), (name, lazy)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert all(f.endswith((".safetensors", ".json")) for f in files), files


def test_dense_factors_are_rebuilt_and_the_statistics_run_over_the_rotated_weights():
    anchor = small_kfac_anchor()
    a, g = anchor.kfac_factors("proj.weight")
    assert torch.allclose(a, psd(4, 1), atol=1e-5) and torch.allclose(g, psd(3, 2), atol=1e-5)
    stats = anchor.metadata["statistics"]
    # coordinates: 4 norm + 3 x 4 proj + 5 x 3 head; mass: sum F + trace(A) trace(G) per weight
    assert stats["num_parameters"] == 4 + 12 + 15
    mass = float(anchor.fisher["norm.weight"].sum())
    mass += sum(float(torch.trace(x) * torch.trace(y)) for x, y in (anchor.kfac_factors(n) for n in anchor.kfac_names))
    assert stats["total_mass"] == pytest.approx(mass, rel=1e-5)
    assert "kfac_weights=2" in repr(anchor)
    with pytest.raises(KeyError, match="no Kronecker factors for 'norm.weight'"):
        anchor.kfac_factors("norm.weight")


@pytest.mark.parametrize(
    "factor, words",
    [
        (torch.diag(torch.tensor([1.0, -1.0, 2.0, 0.5])), "not positive semi-definite"),
        (torch.triu(torch.ones(4, 4)), "not symmetric"),
        (torch.full((4, 4), float("inf")), "NaN/Inf"),
    ],
)
def test_broken_factors_are_refused_naming_the_weight(factor, words):
    with pytest.raises(AnchorValidationError, match=f"'proj.weight'.*{words}"):
        FisherAnchor({}, name="m", kfac={"proj.weight": (factor, psd(3, 0))})


def test_a_corrupt_saved_basis_fails_at_load(tmp_path):
    small_kfac_anchor().save_pretrained(tmp_path)
    from safetensors.torch import load_file, save_file

    tensors = load_file(tmp_path / "fisher.safetensors")
    tensors["kfac/proj.weight/g_values"] = -tensors["kfac/proj.weight/g_values"]
    save_file(tensors, tmp_path / "fisher.safetensors")
    with pytest.raises(AnchorValidationError, match="negative eigenvalues"):
        FisherAnchor.from_pretrained(tmp_path)


def test_combine_of_two_halves_is_the_estimate_on_all_the_sequences():
    """Factors pooled from two anchors of given sequences equal the anchor of all of them (G a mean over sequences,
    A over tokens; the halves have different token counts)."""
    model = tiny_llama(vocab_size=30, hidden_size=8, layers=1, seed=2)
    prompts, responses = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [3, 1]], [[5, 6], [7, 8, 9, 1], [2], [4, 4, 4]]

    def estimate(part, name):
        return estimate_fisher(
            model,
            None,
            [prompts[i] for i in part],
            num_sequences=len(part),
            estimator="empirical",
            responses=[responses[i] for i in part],
            structure="kfac",
            show_progress=False,
            name=name,
        )

    whole = estimate(range(4), "whole")
    pooled = FisherAnchor.combine([estimate([0, 1], "a"), estimate([2, 3], "b")])
    assert pooled.metadata["num_tokens"] == whole.metadata["num_tokens"]
    for name in whole.kfac_names:
        for got, want in zip(pooled.kfac_factors(name), whole.kfac_factors(name), strict=True):
            assert torch.allclose(got, want, rtol=1e-4, atol=1e-6 * float(want.abs().max())), name


def test_combine_and_compare_refuse_mixed_structures_and_truncated_parts():
    kfac = small_kfac_anchor()
    diagonal = FisherAnchor(
        {"norm.weight": torch.ones(4), "proj.weight": torch.ones(3, 4), "head.weight": torch.ones(5, 3)},
        name="flat",
        metadata={"base_model": "org/base"},
    )
    with pytest.raises(AnchorMismatchError, match="factor different weights"):
        FisherAnchor.combine([kfac, diagonal])
    with pytest.raises(AnchorMismatchError, match="Kronecker-factored.*diagonal"):
        compare_anchors(kfac, diagonal)
    truncated = FisherAnchor(
        {"norm.weight": torch.ones(4)},
        name="t",
        metadata={"base_model": "org/base", "num_tokens": 3.0},
        kfac={
            "proj.weight": kfac.kfac["proj.weight"].__class__(
                kfac.kfac["proj.weight"].a_vectors[:, :2],
                kfac.kfac["proj.weight"].a_values[:2],
                kfac.kfac["proj.weight"].g_vectors,
                kfac.kfac["proj.weight"].g_values,
            ),
            "head.weight": kfac.kfac["head.weight"],
        },
    )
    with pytest.raises(CFPArgumentError, match="truncated"):
        FisherAnchor.combine([kfac, truncated])


def test_compare_of_k_fac_anchors_reads_the_implied_diagonal_and_the_factor_cosines():
    a, b = small_kfac_anchor("a", 0), small_kfac_anchor("b", 0)
    found = compare_anchors(a, b)
    assert found["cosine"] == pytest.approx(1.0) and found["factor_cosine"] == pytest.approx({"A": 1.0, "G": 1.0})
    other = compare_anchors(a, small_kfac_anchor("c", 7))
    assert other["factor_cosine"]["A"] < 0.999


def test_card_says_the_structure(tmp_path):
    text = str(render_card(small_kfac_anchor(), "org/base:cfp/math"))
    assert "Kronecker-factored (K-FAC)" in text and "2 Linear weights" in text and "Within layers only" in text
    config = tmp_path / "cfp_config.json"
    small_kfac_anchor().save_pretrained(tmp_path)
    assert json.loads(config.read_text())["name"] == "math"
