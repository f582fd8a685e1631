"""The evidence anchors: a truncated K-FAC anchor's factors against the top-r eigenpairs of the full factors
(float64 `eigh` here), the pairwise-pooled K-FAC anchor of four parts against `FisherAnchor.combine` of all four
at once (the estimate on all their sequences), and the store's bookkeeping: what is missing, what is saved,
which K-FAC anchors an arm keeps in memory. Anchors are estimated on the tiny pipeline model."""

from dataclasses import replace

import pytest
import torch
from support.extras import needs

needs("trl", "datasets")

from evidence.anchors import AnchorStore  # noqa: E402
from evidence.controls import truncated_anchor  # noqa: E402
from evidence.plan import TINY  # noqa: E402
from evidence.run import tiny_model_and_tokenizer  # noqa: E402

from hf_cfp import FisherAnchor  # noqa: E402


def _psd(n: int, generator: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, n + 2, generator=generator, dtype=torch.float64)
    return x @ x.T / n


def _top(matrix: torch.Tensor, rank: int) -> torch.Tensor:
    values, vectors = torch.linalg.eigh(matrix)
    values, vectors = values.flip(0)[:rank], vectors.flip(1)[:, :rank]
    return vectors @ torch.diag(values) @ vectors.T


def test_truncated_anchor_keeps_the_top_eigenpairs_of_each_factor():
    g = torch.Generator().manual_seed(0)
    a, gg = _psd(6, g), _psd(5, g)
    bias = torch.rand(5, generator=g)
    full = FisherAnchor({"b": bias}, name="full", kfac={"w": (a.float(), gg.float())})
    cut = truncated_anchor(full, 2, "cut")
    got_a, got_g = cut.kfac_factors("w")
    assert torch.allclose(got_a.double(), _top(a, 2), atol=1e-5 * float(a.abs().max()))
    assert torch.allclose(got_g.double(), _top(gg, 2), atol=1e-5 * float(gg.abs().max()))
    assert torch.equal(cut.fisher["b"], bias.float()) and cut.name == "cut"
    assert cut.metadata["kfac_rank"] == 2 and cut.metadata["derived_from"] == "full"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    model, tokenizer = tiny_model_and_tokenizer()
    plan = replace(TINY, kfac_sizes=(16, 32), kfac_ranks=(2,), quality_sequences=(), token_sequences=0)
    return AnchorStore(model, tokenizer, plan, tmp_path_factory.mktemp("anchors"))


def test_the_pairwise_pooled_kfac_anchor_is_the_anchor_of_all_its_parts(store):
    assert store.missing({"math_kfac_n32"}) == [
        "math_kfac",
        "math_kfac_part1",
        "math_kfac_part2",
        "math_kfac_part3",
        "math_kfac_n32",
    ]
    store.prepare({"math_kfac_n32"})
    assert store.missing({"math_kfac_n32", "math_kfac_n16"}) == []  # its first half was planned: made and saved
    tree = store.fetch("math_kfac_n32")
    parts = [store.fetch(n) for n in ("math_kfac", "math_kfac_part1", "math_kfac_part2", "math_kfac_part3")]
    flat = FisherAnchor.combine(parts, name="flat")
    assert [p["name"] for p in tree.metadata["combined_from"]] == ["math_kfac_n16", "math_kfac_n32_b"]
    assert tree.kfac_names == flat.kfac_names and tree.kfac_names
    for name in flat.kfac_names:
        for got, want in zip(tree.kfac_factors(name), flat.kfac_factors(name), strict=True):
            assert torch.allclose(got, want, rtol=0, atol=2e-5 * float(want.abs().max()))
    for name, want in flat.fisher.items():
        assert torch.allclose(tree.fisher[name], want, rtol=1e-6, atol=0)
    assert tree.metadata["num_tokens"] == sum(p.metadata["num_tokens"] for p in parts)


def test_an_arm_keeps_only_its_own_kfac_anchors_in_memory(store):
    first = store.for_arm({"math", "math_kfac", "math_kfac_r2"})
    assert set(first) == {"math", "math_kfac", "math_kfac_r2"}
    name = first["math_kfac"].kfac_names[0]
    assert first["math_kfac_r2"].kfac[name].a_vectors.shape[1] == 2 < first["math_kfac"].kfac[name].a_vectors.shape[1]
    second = store.for_arm({"code", "math_kfac_n16"})
    assert set(store.loaded) == {"math", "code", "math_kfac_n16"}  # K-FAC ones of the first arm dropped
    assert second["code"].structure == "diagonal" and second["math_kfac_n16"].structure == "kfac"
