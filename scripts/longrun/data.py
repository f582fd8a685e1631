"""The long run's data, built in code from templates and the base model's own answers (nothing downloaded):

- `generic_prompts()`: 640 everyday prompts, `TEMPLATES` x `SUBJECTS` (no arithmetic, no code, nothing a safe
  assistant refuses), in a fixed shuffled order; the first `train` are the training prompts, the rest held out.
- `piratize(text)`: the pirate lexicon substitution, `"Arr, " + text` with every word of `LEXICON` swapped (case
  kept) and a final "-ing" cut to "-in'" ("sailing" -> "sailin'"). Deterministic, so that the target of a prompt
  is a fixed function of the base model's greedy answer to it.
- `task_items(model, tokenizer, prompts, new_tokens)`: (prompt, plain answer, pirate answer) per prompt, the plain
  answer being the base model's greedy answer cut to its last full sentence; SFT trains on (prompt, pirate), DPO
  prefers the pirate answer to the plain one. The answers are cached as JSON lines by the caller (`run`).
- `math_problems(count)`: one- and two-step integer arithmetic in the bundled math prompts' style, with answers,
  from a seeded generator: a + b, a - b, a x b, a + b + c, a + b - c and a two-step word problem.
"""

import random
import re

from hf_cfp.evaluation import greedy_answers

TEMPLATES = (
    "Describe {s}.",
    "Tell me about {s}.",
    "What do you think of {s}?",
    "Write one sentence about {s}.",
    "Why do people like {s}?",
    "What is special about {s}?",
    "Give me a fun fact about {s}.",
    "How would you explain {s} to a child?",
    "What comes to mind when you think of {s}?",
    "Say something nice about {s}.",
    "What is the best thing about {s}?",
    "Share a short thought on {s}.",
    "How does {s} make you feel?",
    "Write a short greeting that mentions {s}.",
    "What would you tell a friend about {s}?",
    "Give one tip about {s}.",
)
SUBJECTS = (
    "the sea", "coffee", "cats", "dogs", "a rainy day", "the market", "a garden", "the mountains", "winter",
    "summer", "a good book", "the night sky", "a small village", "bread", "music", "an old bridge", "the forest",
    "a river", "birds", "the morning", "a long walk", "friendship", "the city", "a festival", "tea", "the wind",
    "an island", "the harbour", "a lighthouse", "apples", "the beach", "a storm", "horses", "the moon", "autumn",
    "a museum", "cooking", "a map", "a quiet evening", "the library",
)  # fmt: skip
# word -> pirate word; every value but "o'" and "fer" is in the RL reward's lexicon (`evidence.rewards`)
LEXICON = {
    "you": "ye", "your": "yer", "yours": "yer", "yes": "aye", "hello": "ahoy", "hi": "ahoy", "my": "me",
    "friend": "matey", "friends": "mateys", "is": "be", "are": "be", "am": "be", "of": "o'", "for": "fer",
    "boat": "ship", "boats": "ships", "people": "crew", "money": "gold", "journey": "voyage", "trip": "voyage",
}  # fmt: skip
WORD = re.compile(r"[A-Za-z]+")
SENTENCE_END = re.compile(r"[.!?](?=\s|$)")


def generic_prompts(seed: int = 0) -> list[str]:
    """Every `TEMPLATES` x `SUBJECTS` prompt (640), shuffled by `random.Random(seed)`."""
    prompts = [t.format(s=s) for s in SUBJECTS for t in TEMPLATES]
    random.Random(seed).shuffle(prompts)
    return prompts


def _pirate_word(match: re.Match) -> str:
    word = match[0]
    lower = word.lower()
    swapped = LEXICON.get(lower)
    if swapped is None and lower.endswith("ing") and len(lower) > 5:
        swapped = lower[:-1] + "'"
    if swapped is None:
        return word
    return swapped.capitalize() if word[0].isupper() else swapped


def piratize(text: str) -> str:
    """`"Arr, " + text` with `LEXICON`'s words swapped and "-ing" (words of 6+ letters) cut to "-in'", case kept;
    the first letter of `text` is lower-cased after "Arr, " unless it starts a word kept in capitals ("I")."""
    body = WORD.sub(_pirate_word, text.strip())
    if body[:1].isupper() and not body.startswith("I "):
        body = body[0].lower() + body[1:]
    return "Arr, " + body


def full_sentences(text: str) -> str:
    """`text` cut after its last sentence end (. ! ? followed by a space or the end), stripped; the whole
    stripped text when it has none."""
    ends = [m.end() for m in SENTENCE_END.finditer(text)]
    return (text[: ends[-1]] if ends else text).strip()


def task_items(model, tokenizer, prompts: list[str], new_tokens: int, batch_size: int = 32) -> list[dict]:
    """{"prompt", "plain", "pirate"} per prompt: the base model's greedy answer (`greedy_answers`, at most
    `new_tokens`, special tokens dropped) cut to full sentences, and its `piratize`d form."""
    answers = greedy_answers(model, tokenizer, prompts, max_new_tokens=new_tokens, batch_size=batch_size)
    plain = [full_sentences(text) for text in tokenizer.batch_decode(answers, skip_special_tokens=True)]
    return [{"prompt": p, "plain": a, "pirate": piratize(a)} for p, a in zip(prompts, plain, strict=True) if a]


def math_problems(count: int, seed: int = 0) -> list[tuple[str, int]]:
    """`count` (prompt, answer) pairs, the kinds in turn (a + b, a - b, a x b, a + b + c, a + b - c and a two-step
    word problem), small operands from `random.Random(seed)` (a 135M model gets some of them right, so that a loss
    shows); every prompt ends "Reply with the number only."."""
    rng = random.Random(seed)
    items = []
    for n in range(count):
        a, b, c = rng.randint(2, 20), rng.randint(2, 20), rng.randint(1, 9)
        kind = n % 6
        if kind == 0:
            question, answer = f"What is {a} + {b}?", a + b
        elif kind == 1:
            a, b = max(a, b), min(a, b)
            question, answer = f"What is {a} - {b}?", a - b
        elif kind == 2:
            question, answer = f"What is {c} times {b % 9 + 2}?", c * (b % 9 + 2)
        elif kind == 3:
            question, answer = f"What is {a} + {b} + {c}?", a + b + c
        elif kind == 4:
            question, answer = f"What is {a} + {b} - {c}?", a + b - c
        else:
            question = f"Sam has {a} marbles, wins {b} more and then gives away {c}. How many marbles does Sam have?"
            answer = a + b - c
        items.append((f"{question} Reply with the number only.", answer))
    return items
