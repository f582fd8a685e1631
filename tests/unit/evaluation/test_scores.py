"""reference_log_likelihood and greedy_exact_match against plain per-item loops on a tiny Llama, and the
bundled held-out math set: answers checked by Python arithmetic, prompts disjoint from the calibration set."""

import re

import pytest
import torch
from support.tiny import tiny_llama, tiny_tokenizer

from hf_cfp.evaluation import final_number, greedy_exact_match, reference_log_likelihood
from hf_cfp.loading.prompts import calibration_prompts, math_eval_items

PROMPTS = ["two plus three", "what is the sum", "print five", "the answer is", "code", "three plus two is what"]


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def chat_ids(tokenizer, prompt: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@torch.no_grad()
def loop_log_likelihood(model, prompt_ids: list[list[int]], answer_ids: list[list[int]]) -> float:
    """(1/N) sum_i (1/|a_i|) sum_t log softmax(model(x_i a_i,<t))[a_i,t], one forward per token."""
    per_item = []
    for x, a in zip(prompt_ids, answer_ids, strict=True):
        total = 0.0
        for t in range(len(a)):
            logits = model(input_ids=torch.tensor([x + a[:t]])).logits[0, -1].double()
            total += float(torch.log_softmax(logits, dim=-1)[a[t]])
        per_item.append(total / len(a))
    return sum(per_item) / len(per_item)


def test_reference_log_likelihood_is_the_per_token_mean_of_a_plain_loop(tokenizer):
    model = tiny_llama(vocab_size=len(tokenizer), hidden_size=32, heads=4)
    answers = [5, 12, 340, "five", "the answer is 7", 1]  # different lengths: padding in the batch
    expected = loop_log_likelihood(
        model.eval(),
        [chat_ids(tokenizer, p) for p in PROMPTS],
        [tokenizer(str(a), add_special_tokens=False)["input_ids"] for a in answers],
    )
    model.train()
    for batch_size in (1, 4, 8):
        assert reference_log_likelihood(model, tokenizer, PROMPTS, answers, batch_size=batch_size) == pytest.approx(
            expected, abs=1e-5
        )
    assert model.training  # mode restored
    assert expected < -3.0  # a random model: about log(1 / vocab) per token


def test_reference_log_likelihood_of_token_ids_without_a_tokenizer():
    model = tiny_llama(vocab_size=32).eval()
    prompts, answers = [[1, 2, 3], [4, 5], [6, 7, 8, 9]], [[10], [11, 12, 13], [14, 15]]
    expected = loop_log_likelihood(model, prompts, answers)
    assert reference_log_likelihood(model, None, prompts, answers, batch_size=2) == pytest.approx(expected, abs=1e-5)


def digit_model(tokenizer):
    """A tiny Llama whose output layer can only prefer digit tokens (every other row of lm_head is 0, so
    its logit is 0 while the best of 10 random digit logits is almost surely above it): greedy answers
    are numbers, so exact match is not trivially 0."""
    model = tiny_llama(vocab_size=len(tokenizer), hidden_size=32, heads=4, seed=3).eval()
    digits = {tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)}
    with torch.no_grad():
        for token in range(len(tokenizer)):
            if token not in digits:
                model.lm_head.weight[token].zero_()
    return model


def test_greedy_exact_match_equals_a_plain_generate_loop(tokenizer):
    model = digit_model(tokenizer)
    numbers = []
    for prompt in PROMPTS:  # one unpadded model.generate per item, greedy
        ids = torch.tensor([chat_ids(tokenizer, prompt)])
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=6,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        found = re.findall(r"-?\d+(?:,\d{3})*(?:\.\d+)?", text)  # the last number in the response
        numbers.append(float(found[-1].replace(",", "")) if found else None)
    assert all(n is not None for n in numbers)
    answers = [int(n) if i % 2 == 0 else int(n) + 1 for i, n in enumerate(numbers)]  # every other one right
    assert greedy_exact_match(model, tokenizer, PROMPTS, answers, max_new_tokens=6, batch_size=4) == 0.5
    assert greedy_exact_match(model, tokenizer, PROMPTS, [int(n) for n in numbers], max_new_tokens=6) == 1.0
    assert greedy_exact_match(model, tokenizer, PROMPTS, [str(int(n)) for n in numbers], max_new_tokens=6) == 1.0


def test_final_number_regex():
    assert final_number("The answer is 1,250 apples.") == 1250.0
    assert final_number("x = 7, then -3.5") == -3.5
    assert final_number("38 + 47 = 85") == 85.0
    assert final_number("42") == 42.0
    assert final_number("no digits") is None


def normalized(text: str) -> str:
    return " ".join(text.lower().split())


def test_bundled_math_eval_answers_are_right():
    """Each answer recomputed with Python arithmetic, in file order."""
    expressions = [
        "38 + 47", "93 - 58", "14 * 6", "132 // 4", "250 + 375", "9 * 9 - 10", "7 ** 3", "1000 - 436",
        "360 * 25 // 100", "12 + 19 + 31", "45 + 28", "12 * 7", "96 // 8", "63 - 27", "40 * 6", "15 * 9",
        "5 * 14", "84 // 7", "3 + 5 + 4", "(14 * 60 + 135) - 15 * 60", "6 * 60", "11 * 8", "30 - 18", "13 * 11",
    ]  # fmt: skip
    items = math_eval_items()
    assert len(items) == len(expressions) == 24
    assert [answer for _, answer in items] == [eval(e) for e in expressions]  # noqa: S307 (fixed literals)
    assert 132 % 4 == 96 % 8 == 84 % 7 == 0  # the divisions are exact
    assert len({normalized(p) for p, _ in items}) == 24


def test_bundled_math_eval_is_disjoint_from_the_calibration_prompts():
    held_out = [normalized(p) for p, _ in math_eval_items()]
    calibration = [normalized(p) for p in calibration_prompts("math")]
    for e in held_out:
        for c in calibration:
            assert e != c and e not in c and c not in e, (e, c)
