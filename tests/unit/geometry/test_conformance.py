"""Every registered geometry (`hf_cfp.geometry.registry.GEOMETRIES`) through one contract, against its own quadratic
formed densely in float64 (`Geometry.dense`, on row-major vec(Delta)):

- the correction is the proximal map vec(Delta) = (I + lam F)^-1 vec(Delta'), a dense float64 solve;
- the drift metrics and the KL budget's terms are the dense quadratic's: sensitive drift^2 = Delta^T F Delta,
  predicted KL = half of it, and after a correction with lam, KL = 0.5 Delta_lam^T F Delta_lam and
  dKL / dlam = -Delta_lam^T F (I + lam F)^-1 F Delta_lam with Delta_lam = (I + lam F)^-1 Delta;
- an anchor saved and loaded back (in memory, and lazily) has the same quadratic, bit for bit, and corrects alike;
- bound under a PEFT model, a LoRA-adapted weight's merged displacement is measured by the same quadratic.

Every structure (`registry.STRUCTURES`) is estimated, and each of its geometries must describe some parameter of
the anchor; a structure mixes geometries, so every parameter is checked with the quadratic of the geometry that
describes it, and every registered geometry belongs to some structure.
"""

import pytest
import torch
from support.extras import requires

from hf_cfp import FisherAnchor, estimate_fisher
from hf_cfp.geometry import GEOMETRIES, STRUCTURES, geometry
from hf_cfp.geometry.base import complete
from hf_cfp.loading.models import tiny_llama
from hf_cfp.names import PREDICTED_KL, SENSITIVE_DRIFT, TOTAL_DRIFT
from hf_cfp.protection import CFPState

LAM = 3.0
# estimate options per structure: the Kronecker geometry at full rank and truncated to 3 eigenpairs with tails
OPTIONS: dict[str, list[dict]] = {"kfac": [{}, {"kfac_rank": 3}]}
CASES = [(structure, options) for structure in STRUCTURES for options in OPTIONS.get(structure, [{}])]


def test_every_registered_geometry_is_checked():
    assert {g for structure, _ in CASES for g in STRUCTURES[structure]} == set(GEOMETRIES) and len(GEOMETRIES) >= 2


def estimated(structure: str, options: dict, seed: int = 0):
    model = tiny_llama(vocab_size=40, hidden_size=16, layers=1, seed=seed)
    anchor = estimate_fisher(
        model,
        None,
        [[1, 2, 3], [4, 5, 6, 7]],
        num_sequences=6,
        max_new_tokens=4,
        batch_size=3,
        seed=seed,
        structure=structure,
        show_progress=False,
        name="math",
        **options,
    )
    return model, anchor


def quadratics(anchor, structure: str | None = None) -> dict[str, torch.Tensor]:
    """Every parameter of the anchor -> the dense float64 F of the geometry that describes it (exactly one); each
    geometry of `structure` describes some."""
    found: dict[str, torch.Tensor] = {}
    used = set()
    for name in [*anchor.fisher, *anchor.kfac]:
        dense = [(g, d) for g in GEOMETRIES if (d := geometry(g).dense(anchor, name)) is not None]
        assert len(dense) == 1, f"{name}: described by {len(dense)} geometries"
        used.add(dense[0][0])
        found[name] = dense[0][1]
    assert structure is None or used == set(STRUCTURES[structure]), f"{structure}: only {used} describe parameters"
    return found


def displaced(model, seed: int = 1, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """Move every parameter by a random Delta; returns theta0 (float64) by name."""
    generator = torch.Generator().manual_seed(seed)
    theta0 = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=generator))
    return theta0


def delta(model, theta0, name) -> torch.Tensor:
    return (model.get_parameter(name).detach().double() - theta0[name]).reshape(-1)


@pytest.mark.parametrize(("structure", "options"), CASES)
def test_correction_is_the_dense_proximal_solve(structure, options):
    model, anchor = estimated(structure, options)
    dense = quadratics(anchor, structure)
    state = CFPState(model, anchor)
    theta0 = displaced(model)
    proposal = {n: delta(model, theta0, n) for n in dense}
    state.correct(LAM)
    for n, f in dense.items():
        want = torch.linalg.solve(torch.eye(len(f), dtype=torch.float64) + LAM * f, proposal[n])
        got = delta(model, theta0, n)
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-6), n


@pytest.mark.parametrize(("structure", "options"), CASES)
def test_drift_and_budget_terms_are_the_dense_quadratic(structure, options):
    model, anchor = estimated(structure, options)
    dense = quadratics(anchor)
    state = CFPState(model, anchor)
    theta0 = displaced(model)
    d = {n: delta(model, theta0, n) for n in dense}
    sensitive = sum(float(d[n] @ f @ d[n]) for n, f in dense.items())
    metrics = state.drift_metrics()
    assert metrics[SENSITIVE_DRIFT.key("math")] ** 2 == pytest.approx(sensitive, rel=1e-5)
    assert metrics[PREDICTED_KL.key("math")] == pytest.approx(0.5 * sensitive, rel=1e-5)
    total = sum(float(t.square().sum()) for t in d.values())
    assert metrics[TOTAL_DRIFT.key()] ** 2 == pytest.approx(total, rel=1e-5)
    kl = slope = 0.0
    for n, f in dense.items():
        inverse = torch.linalg.inv(torch.eye(len(f), dtype=torch.float64) + LAM * f)
        corrected = inverse @ d[n]
        kl += 0.5 * float(corrected @ f @ corrected)
        slope -= float(corrected @ f @ inverse @ f @ corrected)
    terms = complete(state.geometries, [g.budget_terms([LAM]) for g in state.geometries])
    assert float(terms[0, 0]) == pytest.approx(kl, rel=1e-5)
    assert float(terms[1, 0]) == pytest.approx(slope, rel=1e-5)


@pytest.mark.parametrize(("structure", "options"), CASES)
def test_save_and_load_keep_the_quadratic_and_the_correction(structure, options, tmp_path):
    model, anchor = estimated(structure, options)
    anchor.save_pretrained(tmp_path)
    dense = quadratics(anchor)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    corrected = []
    for loaded in (anchor, FisherAnchor.from_pretrained(tmp_path), FisherAnchor.from_pretrained(tmp_path, lazy=True)):
        assert all(torch.equal(f, quadratics(loaded)[n]) for n, f in dense.items())
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(start[n])
        state = CFPState(model, loaded)
        displaced(model)
        state.correct(LAM)
        corrected.append({n: p.detach().clone() for n, p in model.named_parameters()})
    assert all(torch.equal(corrected[0][n], other[n]) for other in corrected[1:] for n in corrected[0])


@requires("peft")
@pytest.mark.parametrize(("structure", "options"), CASES)
def test_binding_under_peft_measures_the_merged_displacement(structure, options):
    from peft import LoraConfig, get_peft_model  # optional (the `peft` extra): the test is skipped without it

    model, anchor = estimated(structure, options)
    dense = quadratics(anchor)
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    state = CFPState(peft_model, anchor)
    generator = torch.Generator().manual_seed(3)
    sensitive = total = 0.0
    with torch.no_grad():
        for module_name, module in peft_model.named_modules():
            if not hasattr(module, "lora_B") or "default" not in module.lora_B:
                continue
            module.lora_B["default"].weight.copy_(
                torch.randn(module.lora_B["default"].weight.shape, generator=generator)
            )
            a, b = module.lora_A["default"].weight.double(), module.lora_B["default"].weight.double()
            merged = (float(module.scaling["default"]) * b @ a).reshape(-1)
            base = module_name.removeprefix("base_model.model.") + ".weight"
            sensitive += float(merged @ dense[base] @ merged)
            total += float(merged.square().sum())
    assert total > 0
    metrics = state.drift_metrics()
    assert metrics[SENSITIVE_DRIFT.key("math")] ** 2 == pytest.approx(sensitive, rel=1e-5)
    assert metrics[TOTAL_DRIFT.key()] ** 2 == pytest.approx(total, rel=1e-5)
