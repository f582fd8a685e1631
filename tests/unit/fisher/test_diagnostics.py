"""diagnose (hf_cfp.fisher.diagnostics) and `hf-cfp diagnose`: against a per-parameter Python loop on a tiny Llama,
and in closed form on a one-logit-per-response bandit, where F = pi (1 - pi) exactly and two responses attain the
bound."""

import math
from types import SimpleNamespace

import pytest
import torch
from support.references import ref_sequence_score
from support.tiny import tiny_llama, tiny_tokenizer

from hf_cfp import FisherAnchor
from hf_cfp.cli import main
from hf_cfp.errors import AnchorMismatchError
from hf_cfp.fisher.diagnostics import diagnose, diagnose_anchors, sft_signal_log_second_moment
from hf_cfp.loading.examples import sft_examples
from hf_cfp.loading.models import load_causal_lm
from hf_cfp.loading.prompts import load_pairs

# rows of a right-padded batch: (prompt length, response length); labels -100 on prompts and padding
ROWS = [(3, 4), (1, 6), (5, 2), (2, 5), (4, 3)]
WIDTH = 8


def llama_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 32, (len(ROWS), WIDTH), generator=g)
    mask, labels = torch.zeros_like(ids), torch.full_like(ids, -100)
    for b, (p, r) in enumerate(ROWS):
        mask[b, : p + r] = 1
        labels[b, p : p + r] = ids[b, p : p + r]
    return ids, labels, mask


def reference(model, ids):
    """Per row, one plain forward of the unpadded sequence (float64 log-softmax): g_i = mean_b score_b,i as
    Python floats in model.named_parameters() order, and E[a^2] = mean_b (1/pi(y_b|x_b) - 1)."""
    names = [n for n, _ in model.named_parameters()]
    g = [[0.0] * p.numel() for _, p in model.named_parameters()]
    second_moment = 0.0
    for b, (p, r) in enumerate(ROWS):
        prompt, response = ids[b, :p].tolist(), ids[b, p : p + r].tolist()
        for k, score in enumerate(ref_sequence_score(model, prompt, response)):
            for i, value in enumerate(score.reshape(-1).tolist()):
                g[k][i] += value / len(ROWS)
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0].double()
        log_prob = sum(float(logits[p - 1 + t].log_softmax(0)[tok]) for t, tok in enumerate(response))
        second_moment += (math.exp(-log_prob) - 1) / len(ROWS)
    return names, g, second_moment


def top_set(values, k):
    return set(sorted(range(len(values)), key=lambda i: (-values[i], i))[:k])


def test_diagnose_matches_a_per_parameter_loop():
    model = tiny_llama(vocab_size=32, hidden_size=16)
    ids, labels, mask = llama_batch()
    names, g, second_moment = reference(model, ids)
    scale = math.sqrt(second_moment)
    # F_i = (g_i / scale)^2 u_i, u_i log-uniform in [0.1, 100], so that r_i = u_i^(-1/2) straddles 0.5 and 1;
    # 3% of coordinates get F_i = 0 (unbounded where g_i != 0); unused embedding rows have g_i = 0 exactly.
    gen = torch.Generator().manual_seed(1)
    fisher = {}
    for name, values in zip(names, g, strict=True):
        u = 10 ** (3 * torch.rand(len(values), generator=gen, dtype=torch.float64) - 1)
        f = (torch.tensor(values, dtype=torch.float64) / scale) ** 2 * u
        f[torch.rand(len(values), generator=gen) < 0.03] = 0.0
        fisher[name] = f.float().reshape(dict(model.named_parameters())[name].shape)
    anchor = FisherAnchor(fisher, name="math")
    result = diagnose(model, anchor, ids, labels, mask, batch_size=2)

    flat_g = [v for values in g for v in values]
    flat_f = [float(v) for name in names for v in fisher[name].reshape(-1).tolist()]
    n, k = len(flat_g), math.ceil(0.01 * len(flat_g))
    top_f = top_set(flat_f, k)
    ratios = []
    for gi, fi in zip(flat_g, flat_f, strict=True):
        ratios.append(0.0 if gi == 0 else (math.inf if fi == 0 else abs(gi) / (math.sqrt(fi) * scale)))
    assert result.num_coordinates == n and result.num_sequences == len(ROWS)
    assert result.num_tokens == sum(r for _, r in ROWS)
    assert result.energy_share == pytest.approx(sum(flat_g[i] ** 2 for i in top_f) / sum(v * v for v in flat_g), 1e-5)
    assert result.top_overlap == len(top_f & top_set([abs(v) for v in flat_g], k)) / k
    assert result.log10_signal_scale == pytest.approx(math.log10(scale), abs=1e-6)
    assert result.unbounded == sum(1 for gi, fi in zip(flat_g, flat_f, strict=True) if fi == 0 and gi != 0) > 0
    assert result.holds_share == sum(1 for r in ratios if r <= 1) / n
    assert 0.3 < result.holds_share < 0.9 and 0.1 < result.above_half_share < 0.8  # the test can see a wrong scale
    assert result.above_half_share == sum(1 for r in ratios if r > 0.5) / n
    assert result.ratio_median == pytest.approx(sorted(ratios)[(n - 1) // 2], rel=1e-4)
    assert result.ratio_max == math.inf
    required = max(abs(gi) / math.sqrt(fi) for gi, fi in zip(flat_g, flat_f, strict=True) if fi > 0)
    assert result.log10_required_scale == pytest.approx(math.log10(required), abs=1e-5)


def assert_same_report(a, b):
    for field, value in vars(a).items():
        assert getattr(b, field) == (value if isinstance(value, (int, str)) else pytest.approx(value, 1e-4)), field


def test_row_chunking_and_left_padding_change_nothing():
    model = tiny_llama(vocab_size=32, hidden_size=16)
    ids, labels, mask = llama_batch(seed=2)
    anchor = FisherAnchor({n: torch.rand(p.shape) for n, p in model.named_parameters()}, name="a")
    whole = diagnose(model, anchor, ids, labels, mask, batch_size=len(ROWS))
    shift = [WIDTH - int(m.sum()) for m in mask]  # the same rows, left-padded
    left = [torch.stack([row.roll(s) for row, s in zip(t, shift, strict=True)]) for t in (ids, labels, mask)]
    assert_same_report(whole, diagnose(model, anchor, ids, labels, mask, batch_size=1))
    assert_same_report(whole, diagnose(model, anchor, *left[:2], left[2]))


def test_several_anchors_share_one_gradient():
    """Anchors over disjoint parameter sets: one gradient over their union, each report as if alone."""
    model = tiny_llama(vocab_size=32, hidden_size=16)
    ids, labels, mask = llama_batch(seed=3)
    named = list(model.named_parameters())
    even = FisherAnchor({n: torch.rand(p.shape) for n, p in named[0::2]}, name="even")
    odd = FisherAnchor({n: torch.rand(p.shape) for n, p in named[1::2]}, name="odd")
    together = diagnose_anchors(model, [even, odd], ids, labels, mask)
    assert [r.anchor for r in together] == ["even", "odd"]
    for report, anchor in zip(together, (even, odd), strict=True):
        assert_same_report(diagnose(model, anchor, ids, labels, mask), report)


class Bandit(torch.nn.Module):
    """One logit per response: pi(y | anything) = softmax(z)[y], so a one-token response has score e_y - pi and,
    on one prompt, the exact diagonal Fisher F_c = pi_c (1 - pi_c)."""

    def __init__(self, logits):
        super().__init__()
        self.z = torch.nn.Parameter(torch.tensor(logits))

    def forward(self, input_ids, **kwargs):
        return SimpleNamespace(logits=self.z.expand(*input_ids.shape, -1))


def bandit_batch(answers):
    """Rows [prompt 0, answer], the answer labelled: the SFT gradient is mean_b (e_{y_b} - pi)."""
    ids = torch.tensor([[0, y] for y in answers])
    return ids, torch.tensor([[-100, y] for y in answers])


def test_two_responses_attain_the_bound():
    """pi = (p, 1 - p), label 0: g = (1 - p, -(1 - p)), F_c = p (1 - p), E[a^2] = 1/p - 1, so
    |g_c| = sqrt(F_c) sqrt(E[a^2]) for both c: Cauchy-Schwarz with a proportional to the score."""
    model = Bandit([0.3, -0.5])
    p = torch.tensor([0.3, -0.5], dtype=torch.float64).softmax(0)
    result = diagnose(model, FisherAnchor({"z": p * (1 - p)}, name="two"), *bandit_batch([0]))
    assert result.ratio_median == pytest.approx(1.0, abs=1e-5) and result.ratio_max == pytest.approx(1.0, abs=1e-5)
    assert result.above_half_share == 1.0 and result.energy_share == pytest.approx(0.5, 1e-5)
    assert result.log10_signal_scale == pytest.approx(0.5 * math.log10(1 / float(p[0]) - 1), abs=1e-6)


def test_three_responses_in_closed_form():
    """Labels 0 and 1 under pi = softmax(z): g = (e_0 + e_1) / 2 - pi, E[a^2] = (1/pi_0 + 1/pi_1) / 2 - 1,
    F = pi (1 - pi); the top 1% of 3 coordinates is the one largest F."""
    z = [1.0, -0.4, 0.2]
    pi = torch.tensor(z, dtype=torch.float64).softmax(0).tolist()
    g = [0.5 - pi[0], 0.5 - pi[1], -pi[2]]
    second_moment = (1 / pi[0] + 1 / pi[1]) / 2 - 1
    fisher = [q * (1 - q) for q in pi]
    ratios = sorted(abs(gc) / math.sqrt(fc * second_moment) for gc, fc in zip(g, fisher, strict=True))
    top = max(range(3), key=lambda c: fisher[c])
    result = diagnose(Bandit(z), FisherAnchor({"z": torch.tensor(fisher)}, name="three"), *bandit_batch([0, 1]))
    assert result.energy_share == pytest.approx(g[top] ** 2 / sum(v * v for v in g), 1e-5)
    assert result.top_overlap == float(top == max(range(3), key=lambda c: abs(g[c])))
    assert result.log10_signal_scale == pytest.approx(0.5 * math.log10(second_moment), abs=1e-6)
    assert result.holds_share == 1.0 and result.unbounded == 0
    assert result.ratio_median == pytest.approx(ratios[1], 1e-5) and result.ratio_max == pytest.approx(ratios[2], 1e-5)
    assert result.above_half_share == sum(1 for r in ratios if r > 0.5) / 3
    assert result.log10_required_scale == pytest.approx(
        math.log10(ratios[2]) + 0.5 * math.log10(second_moment), abs=1e-6
    )


def test_a_gradient_where_the_anchor_has_no_fisher_is_a_violation():
    z = [1.0, -0.4, 0.2]
    pi = torch.tensor(z).softmax(0)
    fisher = pi * (1 - pi)
    fisher[2] = 0.0
    result = diagnose(Bandit(z), FisherAnchor({"z": fisher}, name="hole"), *bandit_batch([0, 1]))
    assert result.unbounded == 1 and result.holds_share == pytest.approx(2 / 3) and result.ratio_max == math.inf


def test_signal_scale_past_float64_range():
    """log pi = -1000 and -1001 nats: 1/pi overflows float64, log E[a^2] = 1000 + log((1 + e) / 2)."""
    value = sft_signal_log_second_moment(torch.tensor([-1000.0, -1001.0], dtype=torch.float64))
    assert value == pytest.approx(1000 + math.log((1 + math.e) / 2), abs=1e-9)
    assert sft_signal_log_second_moment(torch.zeros(3, dtype=torch.float64)) == -math.inf  # every label certain


def test_an_anchor_for_another_model_is_refused():
    model = tiny_llama(vocab_size=32, hidden_size=16)
    ids, labels, mask = llama_batch()
    with pytest.raises(AnchorMismatchError, match=r"'other' does not fit the model.*'lm_head.missing'"):
        diagnose(model, FisherAnchor({"lm_head.missing": torch.ones(3)}, name="other"), ids, labels, mask)
    shape = FisherAnchor({"lm_head.weight": torch.ones(3, 3)}, name="shape")
    with pytest.raises(AnchorMismatchError, match=r"'lm_head.weight' has shape \(3, 3\) in the first"):
        diagnose(model, shape, ids, labels, mask)


@pytest.fixture
def tiny_model_dir(tmp_path):
    tokenizer = tiny_tokenizer()
    model = tiny_llama(vocab_size=len(tokenizer), hidden_size=16, max_position_embeddings=256)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    FisherAnchor({n: torch.rand(p.shape) for n, p in model.named_parameters()}, name="math").save_pretrained(
        tmp_path / "anchor"
    )
    return tmp_path


def test_cli_prints_the_report_of_diagnose(tiny_model_dir, capsys):
    data = tiny_model_dir / "pairs.jsonl"
    data.write_text('{"prompt": "two plus three", "completion": "is five"}\n\n{"prompt": "sum", "response": "code"}\n')
    anchor, model_dir = str(tiny_model_dir / "anchor"), str(tiny_model_dir / "model")
    main(["diagnose", "--anchor", anchor, anchor, "--model", model_dir, "--data", str(data), "--batch-size", "1"])
    out = capsys.readouterr().out
    model, tokenizer = load_causal_lm(model_dir)  # the saved ones, loaded as the CLI does
    rows = sft_examples(tokenizer, [("two plus three", "is five"), ("sum", "code")])
    batch = [torch.stack([row[key] for row in rows]) for key in ("input_ids", "labels", "attention_mask")]
    expected = diagnose(model, FisherAnchor.from_pretrained(anchor), *batch).to_text()
    assert out.count(expected) == 2 and "2 (prompt, response) pairs" in out
    main(["diagnose", "--anchor", anchor, "--model", model_dir, "--num-examples", "3"])  # the bundled SFT set
    assert "batch of 3 sequences" in capsys.readouterr().out and len(load_pairs()) > 3


def test_cli_errors_are_two_lines_and_exit_code_2(tiny_model_dir, capsys):
    model_dir = str(tiny_model_dir / "model")
    bad = tiny_model_dir / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n')
    for argv, message in (
        (["--anchor", str(tiny_model_dir / "missing")], "No anchor directory at"),
        (["--anchor", str(tiny_model_dir / "anchor"), "--data", str(bad)], "bad.jsonl, line 1: give text fields"),
        (
            ["--anchor", str(tiny_model_dir / "anchor"), "--num-examples", "0"],
            "--num-examples: must be an integer >= 1",
        ),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(["diagnose", *argv, "--model", model_dir])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.startswith("hf-cfp diagnose: error: ") and message in err, err
        assert "Traceback" not in err and len(err.splitlines()) == 2
