"""K-FAC anchors through the Trainer, the loop API and the Hub: a run resumed from a checkpoint is bit-identical to
the uninterrupted one, predicted_kl_budget holds the predicted KL of the K-FAC quadratic, the loop API's state_dict
resumes bit for bit, an anchor pushed to a (local) Hub comes back with its factors and protects, and TRL's DPO runs
with it."""

import copy

import pytest
import torch
from support.extras import needs
from support.tiny import tiny_llama, tiny_tokenizer
from support.training import CrashAfterSave, checkpointed_run

from hf_cfp import CFP, CFPCallback, FisherAnchor, estimate_fisher
from hf_cfp.geometry.kronecker import factors as kfac_factors
from hf_cfp.names import LAM, PREDICTED_KL


def kfac_anchor(model, name="math", rank=None):
    return estimate_fisher(
        model,
        None,
        [[1, 2, 3], [4, 5, 6]],
        num_sequences=6,
        max_new_tokens=4,
        batch_size=3,
        seed=0,
        structure="kfac",
        kfac_rank=rank,
        show_progress=False,
        name=name,
    )


def run(output_dir, anchor_dir, extra=(), resume=None, **callback_kwargs):
    cfp = CFPCallback(str(anchor_dir), **callback_kwargs)
    return checkpointed_run(tiny_llama(), output_dir, [cfp, *extra], resume)


@pytest.fixture(scope="module")
def anchor_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("kfac")
    kfac_anchor(tiny_llama()).save_pretrained(directory)
    return directory


def test_a_resumed_run_is_bit_identical(anchor_dir, tmp_path):
    straight, _ = run(tmp_path / "straight", anchor_dir, lam=lambda step: 50.0 * step)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "crashed", anchor_dir, extra=[CrashAfterSave(4)], lam=lambda step: 50.0 * step)
    resumed, _ = run(tmp_path / "crashed", anchor_dir, resume=True, lam=lambda step: 50.0 * step)
    plain, _ = run(tmp_path / "plain", anchor_dir, lam=0.0)
    assert all(torch.equal(resumed[n], straight[n]) for n in straight)
    assert max((straight[n] - plain[n]).abs().max().item() for n in plain) > 1e-3  # the correction acted


def test_kl_budget_holds_the_kfac_prediction_at_every_step(anchor_dir, tmp_path):
    _, logs = run(tmp_path / "budget", anchor_dir, predicted_kl_budget=1e-3)
    steps = [row for row in logs if PREDICTED_KL.key("math") in row]
    assert len(steps) == 6
    assert all(row[PREDICTED_KL.key("math")] <= 1e-3 * (1 + 1e-6) for row in steps)
    assert any(row[LAM.key("math")] > 0 for row in steps)  # the budget was reached and held by a pull


def budget_path(anchor_dir, fused, budget, steps=8):
    """A loop-API run under predicted_kl_budget with torch.optim.AdamW (fused or foreach); after every step, the
    lam, the predicted KL the protection solves with (`predicted_kls`) and the one it logs (from the drift sums)."""
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2, fused=fused, foreach=not fused)
    protector = CFP(model, str(anchor_dir), predicted_kl_budget=budget, optimizer=optimizer)
    ids = torch.randint(0, 32, (4, 10), generator=torch.Generator().manual_seed(0))
    path = []
    for _ in range(steps):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        lams = protector.step()
        path.append((lams[0], protector.protection.predicted_kls()[0], protector.metrics()[PREDICTED_KL.key("math")]))
    return path, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_the_budget_solve_sees_the_weights_a_fused_optimizer_wrote(anchor_dir):
    """A fused AdamW (the Trainer's default optimizer) writes the weights without bumping their version counters:
    the solve must not reuse projections of the weights from before its step. Under fused AdamW the path (lams,
    predicted KL, weights) is the foreach one's, lam_t = 0 on the free steps and > 0 once the budget binds, and the
    predicted KL the solve uses is the logged one, summed afresh."""
    free, _ = budget_path(anchor_dir, fused=False, budget=1e9)
    budget = (free[2][2] + free[3][2]) / 2  # the free path leaves it at step 4
    foreach, foreach_weights = budget_path(anchor_dir, fused=False, budget=budget)
    fused, fused_weights = budget_path(anchor_dir, fused=True, budget=budget)
    assert [lam for lam, _, _ in fused[:3]] == [0.0] * 3 and all(lam > 0 for lam, _, _ in fused[3:]), fused
    assert [v for row in fused for v in row] == pytest.approx([v for row in foreach for v in row], rel=1e-4)
    assert all(solved == pytest.approx(logged, rel=1e-9) for _, solved, logged in fused)
    assert all(q <= budget * (1 + 1e-6) for _, q, _ in fused)
    for name, weight in fused_weights.items():
        assert torch.allclose(weight, foreach_weights[name], atol=1e-5), name


def test_loop_api_state_dict_resumes_bit_for_bit(anchor_dir):
    def steps(model, protector, optimizer, count):
        ids = torch.randint(0, 32, (4, 10), generator=torch.Generator().manual_seed(count))
        for _ in range(count):
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            protector.step()

    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
    protector = CFP(model, str(anchor_dir), lam=100.0, optimizer=optimizer)
    steps(model, protector, optimizer, 2)
    saved = (
        protector.state_dict(),
        {n: p.detach().clone() for n, p in model.named_parameters()},
        copy.deepcopy(optimizer.state_dict()),
    )  # the optimizer's state tensors change in place
    steps(model, protector, optimizer, 2)
    straight = {n: p.detach().clone() for n, p in model.named_parameters()}

    model = tiny_llama()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(saved[1][n])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
    optimizer.load_state_dict(saved[2])
    resumed = CFP(model, str(anchor_dir), lam=100.0, optimizer=optimizer)
    resumed.load_state_dict(saved[0])
    steps(model, resumed, optimizer, 2)
    assert all(torch.equal(p, straight[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("rank", [None, 3])  # 3: with the mean tails, the 32-wide factors sketched
def test_pushed_and_pulled_from_the_hub_it_protects_as_the_original(local_hub, tmp_path, rank, monkeypatch):
    model = tiny_llama()
    if rank is not None:
        monkeypatch.setattr(kfac_factors, "MAX_FORMED_DIMENSION", 20)
    anchor = kfac_anchor(model, rank=rank)
    anchor.push_to_hub("org/anchors")
    files = local_hub.files("org/anchors")
    assert "Kronecker-factored (K-FAC)" in files["cfp/math/README.md"].decode()
    pulled = FisherAnchor.from_pretrained("org/anchors:cfp/math", cache_dir=tmp_path, lazy=True)
    assert pulled.structure == "kfac" and sorted(pulled.kfac_names) == sorted(anchor.kfac_names)
    for name in anchor.kfac_names:
        for got, want in zip(pulled.kfac_factors(name), anchor.kfac_factors(name), strict=True):
            assert torch.equal(got, want)
    theta0 = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    protector = CFP(model, pulled, lam=50.0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    proposal = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    protector.step()
    for name, param in model.named_parameters():  # the dense float64 solve (I + lam kron(G_r, A_r))^-1 vec(D)
        d = (proposal[name] - theta0[name]).reshape(-1)
        if name in anchor.kfac:
            a, gg = (f.double() for f in anchor.kfac_factors(name))
            want = torch.linalg.solve(torch.eye(len(d), dtype=torch.float64) + 50.0 * torch.kron(gg, a), d)
        else:
            want = d / (1 + 50.0 * anchor.fisher[name].double().reshape(-1))
        assert torch.allclose((param.detach().double() - theta0[name]).reshape(-1), want, atol=2e-6), name


def test_trl_dpo_runs_with_a_kfac_anchor(anchor_dir, tmp_path):
    needs("trl", "datasets")
    import datasets
    import trl

    tokenizer = tiny_tokenizer()
    model = tiny_llama(vocab_size=len(tokenizer))
    anchor_dir = tmp_path / "anchor"
    kfac_anchor(model).save_pretrained(anchor_dir)
    pairs = datasets.Dataset.from_dict(
        {"prompt": ["a b", "c d"] * 2, "chosen": [" e f", " g h"] * 2, "rejected": [" i j", " k l"] * 2}
    )
    args = trl.DPOConfig(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
    )
    cfp = CFPCallback(str(anchor_dir), lam=100.0)
    trainer = trl.DPOTrainer(
        model=model,
        ref_model=copy.deepcopy(model),
        args=args,
        train_dataset=pairs,
        processing_class=tokenizer,
        callbacks=[cfp],
    )
    trainer.train()
    logged = [row for row in trainer.state.log_history if PREDICTED_KL.key("math") in row]
    assert logged and logged[-1][PREDICTED_KL.key("math")] > 0
