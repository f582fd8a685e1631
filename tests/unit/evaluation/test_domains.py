"""The bundled capabilities (math, code, safety) and DPO pairs: counts, calibration and held-out prompts
disjoint and far apart, code answers that compile into the named function; is_refusal on hand-written
texts, and refusal_rate against a plain one-prompt-at-a-time generate loop on a tiny Llama."""

import difflib
import json
import re
from importlib import resources

import pytest
import torch
from support.tiny import tiny_llama, tiny_tokenizer

from hf_cfp.errors import CFPArgumentError
from hf_cfp.evaluation import is_refusal, refusal_rate
from hf_cfp.evaluation import scores as scores_module
from hf_cfp.loading.prompts import (
    calibration_prompts,
    eval_items,
    load_pairs,
    load_prompts,
    math_eval_items,
    pirate_preference_triples,
    pirate_style_pairs,
)

DOMAINS = ("math", "code", "safety")
DATA = resources.files("hf_cfp.loading").joinpath("data")
CODE_INSTRUCTION = "Complete this Python function. Reply with the code only.\n\n"


def normalized(text: str) -> str:
    return " ".join(text.lower().split())


@pytest.mark.parametrize("name", DOMAINS)
def test_counts_and_answer_types(name):
    prompts, items = calibration_prompts(name), eval_items(name)
    assert len(prompts) == 32 and len(items) == 24
    assert load_prompts(name) == prompts
    assert all(isinstance(p, str) and p.strip() for p in prompts + [p for p, _ in items])
    answer_type = int if name == "math" else str
    assert all(type(answer) is answer_type for _, answer in items)


@pytest.mark.parametrize("name", DOMAINS)
def test_calibration_and_held_out_prompts_are_disjoint_and_not_near_duplicates(name):
    calibration = [normalized(p) for p in calibration_prompts(name)]
    held_out = [normalized(p) for p, _ in eval_items(name)]
    assert len(set(calibration)) == 32 and len(set(held_out)) == 24  # no repeats within a file
    assert not set(calibration) & set(held_out)
    ratios = [difflib.SequenceMatcher(None, c, e).ratio() for c in calibration for e in held_out]
    assert max(ratios) < 0.9


def test_math_eval_items_is_eval_items_math():
    assert math_eval_items() == eval_items("math")
    assert [type(a) for _, a in math_eval_items()] == [int] * 24


def test_unknown_domain_is_an_error_listing_the_choices():
    for load in (eval_items, calibration_prompts):
        with pytest.raises(CFPArgumentError, match=r"'poetry'.*'math', 'code', 'safety'"):
            load("poetry")


def code_rows():
    """(HumanEval prompt, canonical solution) of each held-out code item, the instruction stripped."""
    items = eval_items("code")
    assert all(prompt.startswith(CODE_INSTRUCTION) for prompt, _ in items)
    return [(prompt[len(CODE_INSTRUCTION) :], answer) for prompt, answer in items]


def test_code_answers_complete_the_named_function():
    """prompt + answer compiles, and executing it (pure functions, no I/O) defines the prompt's last
    `def` (the entry point; earlier ones are helpers), which is a callable."""
    for prompt, answer in code_rows():
        names = re.findall(r"^def (\w+)\(", prompt, flags=re.MULTILINE)
        assert names, prompt
        code = compile(prompt + answer, "<humaneval>", "exec")
        namespace: dict = {}
        exec(code, namespace)  # noqa: S102 (the bundled canonical solutions)
        assert callable(namespace[names[-1]]), names[-1]


def test_code_solutions_compute_known_values():
    """Three held-out solutions run against values worked out by hand."""
    functions = {}
    for prompt, answer in code_rows():
        namespace: dict = {}
        exec(compile(prompt + answer, "<humaneval>", "exec"), namespace)  # noqa: S102
        functions.update({k: v for k, v in namespace.items() if callable(v)})
    assert functions["sum_to_n"](10) == 55  # 1 + 2 + ... + 10
    assert functions["monotonic"]([1, 2, 4, 20]) is True and functions["monotonic"]([1, 20, 4, 10]) is False
    assert functions["common"]([1, 4, 3, 34, 653, 2, 5], [5, 7, 1, 5, 9, 653, 121]) == [1, 5, 653]


def task_numbers(filename: str) -> list[int]:
    """The N of each row's "HumanEval/N" task_id in a bundled data file, in file order."""
    rows = [json.loads(line) for line in DATA.joinpath(filename).read_text(encoding="utf-8").splitlines()]
    return [int(row["task_id"].removeprefix("HumanEval/")) for row in rows]


def test_code_task_ids_are_unique_ordered_and_split_by_task_order():
    calibration, held_out = task_numbers("code.jsonl"), task_numbers("code_eval.jsonl")
    assert (len(calibration), len(held_out), len(set(calibration + held_out))) == (32, 24, 56)
    assert calibration + held_out == sorted(calibration + held_out)  # first 32 by task number calibrate
    license_text = DATA.joinpath("HumanEval-LICENSE.txt").read_text(encoding="utf-8")
    assert "code.jsonl and code_eval.jsonl" in license_text.splitlines()[0] and "MIT License" in license_text


def test_safety_prompts_are_short_and_the_references_are_varied_refusals():
    prompts = calibration_prompts("safety") + [p for p, _ in eval_items("safety")]
    assert max(len(p.split()) for p in prompts) <= 25
    answers = [a for _, a in eval_items("safety")]
    assert len(set(answers)) == 24
    assert all(is_refusal(a) for a in answers)


def test_pirate_preferences_share_the_sft_prompts_and_responses():
    triples, pairs = pirate_preference_triples(), pirate_style_pairs()
    assert len(triples) == len(pairs) == 16
    assert [(p, c) for p, c, _ in triples] == pairs
    for _, chosen, rejected in triples:
        assert chosen != rejected and not rejected.lower().startswith("arr")
        assert 0.5 < len(rejected) / len(chosen) < 2.0  # similar length


def test_load_pairs_reads_the_bundled_set_or_a_jsonl_file(tmp_path):
    assert load_pairs() == load_pairs("pirate_style") == pirate_style_pairs()
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"prompt": "a", "response": "b"}\n\n{"prompt": "c", "completion": "d"}\n')
    assert load_pairs(str(path)) == [("a", "b"), ("c", "d")]
    for text, message in (
        ("not json\n", "line 1: not JSON"),
        ('{"prompt": "a"}\n', "line 1: give text fields"),
        ('["a", "b"]\n', "line 1: give text fields"),
        ("\n", "holds no (prompt, response) pairs"),
    ):
        path.write_text(text)
        with pytest.raises(CFPArgumentError, match=re.escape(message)):
            load_pairs(str(path))
    with pytest.raises(CFPArgumentError, match="neither the bundled 'pirate_style' set nor a .jsonl file"):
        load_pairs(str(tmp_path / "pairs.txt"))


def test_is_refusal_phrases():
    positives = [
        "I can't help with that.",
        "I’m sorry, but I won’t do that.",  # curly apostrophes
        "AS AN AI, I must decline.",
        "That request is not appropriate.",
        "Well... i am unable to assist.",
        "x" * 150 + " I cannot",  # inside the first 200 characters
    ]
    negatives = [
        "Sure, here is how to bake bread.",
        "I can help with that.",
        "The answer is 42.",
        "",
        "x" * 200 + " I cannot",  # after the first 200 characters
    ]
    assert [is_refusal(t) for t in positives] == [True] * len(positives)
    assert [is_refusal(t) for t in negatives] == [False] * len(negatives)


def test_refusal_rate_reads_decoded_greedy_answers(monkeypatch):
    """greedy_answers patched to return known token ids: the rate is the share of refusals among their
    decodings, special tokens skipped ("I can" </s> "'t" reads "I can't")."""
    tokenizer = tiny_tokenizer()

    def encode(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    responses = [encode("I can") + [tokenizer.eos_token_id] + encode("'t do that."), encode("Sure: 5.")]
    responses.append(encode("I'M SORRY, no."))
    calls = []

    def fake_greedy_answers(model, tok, prompts, max_new_tokens, batch_size):
        calls.append((list(prompts), max_new_tokens, batch_size))
        return responses

    monkeypatch.setattr(scores_module, "greedy_answers", fake_greedy_answers)
    assert refusal_rate(None, tokenizer, ["a", "b", "c"], max_new_tokens=7, batch_size=2) == pytest.approx(2 / 3)
    assert calls == [(["a", "b", "c"], 7, 2)]
    responses[2] = encode("Here you go.")
    assert refusal_rate(None, tokenizer, ["a", "b", "c"]) == pytest.approx(1 / 3)
    assert calls[-1][1:] == (32, 8)  # the defaults


def test_refusal_rate_needs_a_tokenizer():
    with pytest.raises(CFPArgumentError, match="tokenizer"):
        refusal_rate(tiny_llama(), None, [[1, 2, 3]])


def loop_responses(model, tokenizer, prompts, max_new_tokens):
    """Each prompt alone (unpadded) through model.generate(do_sample=False), decoded without specials."""
    texts = []
    for prompt in prompts:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        texts.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    return texts


def test_refusal_rate_equals_a_plain_generate_loop_on_a_tiny_llama(monkeypatch):
    tokenizer = tiny_tokenizer()
    model = tiny_llama(vocab_size=len(tokenizer), hidden_size=32, heads=4, eos_token_id=tokenizer.eos_token_id)
    model.eval()
    prompts = [p for p, _ in eval_items("safety")[:6]]
    texts = loop_responses(model, tokenizer, prompts, max_new_tokens=8)
    expected = sum(is_refusal(t) for t in texts) / len(texts)
    assert expected == 0.0  # a random model does not refuse
    assert refusal_rate(model, tokenizer, prompts, max_new_tokens=8, batch_size=4) == expected
    # Again with a "refusal phrase" found in some but not all of the model's responses (the first such
    # 3-character piece), so the batched, left-padded responses must decode as the loop's do to agree.
    pieces = [t[i : i + 3].lower() for t in texts for i in range(len(t) - 2)]
    phrase = next(p for p in pieces if 0 < sum(p in t.lower() for t in texts) < len(texts))
    monkeypatch.setattr(scores_module, "REFUSAL_PHRASES", (phrase,))
    expected = sum(is_refusal(t) for t in texts) / len(texts)
    assert 0.0 < expected < 1.0, texts
    assert refusal_rate(model, tokenizer, prompts, max_new_tokens=8, batch_size=4) == expected
