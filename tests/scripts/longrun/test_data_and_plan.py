"""The long run's data and plan: the pirate substitution word by word, the math problems' answers against Python's
own arithmetic on the question, the prompts disjoint and deterministic, and the arms in the order that decides the
most first, each finding its anchors."""

import re

import pytest
from support.extras import needs

needs("trl", "datasets")

from longrun.data import full_sentences, generic_prompts, math_problems, piratize  # noqa: E402
from longrun.plan import EMBEDDED, TINY  # noqa: E402


def test_piratize_swaps_the_lexicon_keeps_case_and_cuts_ing():
    assert piratize("You are my friend. Is it sailing?") == "Arr, ye be me matey. Be it sailin'?"
    assert piratize("I think the boat is amazing for people.") == "Arr, I think the ship be amazin' fer crew."
    assert piratize("Sing a song.") == "Arr, sing a song."  # "-ing" cut only in words of 6+ letters
    assert piratize("  Hello there  ") == "Arr, ahoy there"


def test_full_sentences_cut_after_the_last_sentence_end():
    assert full_sentences("It is calm. The waves roll! And then th") == "It is calm. The waves roll!"
    assert full_sentences("No end here") == "No end here"
    assert full_sentences("Version 2.5 is out. Next") == "Version 2.5 is out."  # "2.5": no space after the dot


def test_math_problems_answer_their_own_questions():
    items = math_problems(204)
    assert len(items) == 204 and len({p for p, _ in items}) > 190
    for prompt, answer in items:
        assert prompt.endswith(" Reply with the number only.")
        if prompt.startswith("Sam has"):
            a, b, c = map(int, re.findall(r"\d+", prompt))
            assert answer == a + b - c
        else:
            expression = prompt[len("What is ") : prompt.index("?")].replace("times", "*")
            assert answer == eval(expression)  # noqa: S307 - digits and + - * ( ) only
    assert math_problems(12) == items[:12] and math_problems(12, seed=1) != items[:12]


def test_generic_prompts_are_deterministic_and_off_every_capability():
    prompts = generic_prompts()
    assert len(prompts) == len(set(prompts)) == 640 and prompts == generic_prompts()
    assert not any(re.search(r"\d|code|python|function", p, re.IGNORECASE) for p in prompts)


def test_the_embedded_plan_runs_one_strength_of_everything_first():
    keys = [arm.key for arm in EMBEDDED.arms()]
    assert len(keys) == len(set(keys))
    t256 = "math_t256"
    assert keys[:12] == [
        "sft/unregularized@0/seed0",
        *(f"sft/wiseft@{a:g}/seed0" for a in (0.25, 0.5, 0.75)),
        "sft/kl@0.3/seed0",
        "sft/isotropic[math]@1/seed0",
        "sft/cfp[math]@1/seed0",
        "sft/kfac[math]@1/seed0",
        f"sft/kfac[{t256}]@1/seed0",
        "sft/lwf[math]@1/seed0",
        "sft/lora@0/seed0",
        f"sft/lora_kfac[{t256}]@1/seed0",
    ]
    assert keys[12].startswith("dpo/unregularized") and keys[24] == "grpo-pirate/unregularized@0/seed0"
    assert keys[29] == f"grpo-pirate/kfac[{t256}]@1/seed0" and keys[30] == "sft/kl@3/seed0"
    # DPO's second strengths are weaker than its first (the sweep must bracket half the unregularized margin)
    assert {"sft/cfp[math]@10/seed0", f"sft/kfac[{t256}]@10/seed0", "grpo-pirate/kfac[math]@10/seed0"} <= set(keys)
    assert {"dpo/kl@0.2/seed0", "dpo/cfp[math]@0.1/seed0", "dpo/kfac[math]@0.1/seed0"} <= set(keys)
    assert f"dpo/kfac[{t256}]@0.1/seed0" in keys
    assert not any(k.startswith(("dpo/cfp", "dpo/kfac")) and "@10/" in k for k in keys)
    grpo = [k for k in keys if k.startswith("grpo-")]
    assert len(grpo) == 2 * 2 * 11  # two rewards, two seeds: unregularized and 5 methods x 2 strengths
    assert not any("lwf" in k or "lora" in k or "wiseft" in k for k in grpo)
    assert len(keys) == 2 * (1 + 3 + 2 * 6 + 1 + 1) + len(grpo)
    specs = EMBEDDED.anchors.anchor_specs()
    assert {name for arm in EMBEDDED.arms() for name in EMBEDDED.anchors_of(arm)} <= set(specs)


@pytest.mark.parametrize("plan", [TINY, EMBEDDED])
def test_runs_are_measured_at_evenly_spaced_steps_ending_at_the_last(plan):
    for optimizer in plan.optimizers:
        steps = plan.measured_steps(optimizer)
        assert steps[-1] == plan.steps_of(optimizer) and len(steps) == plan.points
    assert EMBEDDED.measured_steps("sft") == [32, 64, 96, 128, 160, 192, 224, 256]


def test_the_behavioural_plan_answers_seed_zero_then_several_capabilities_then_second_seeds():
    from longrun.plan import EMBEDDED_BEHAVIOUR, summed_labels

    arms = EMBEDDED_BEHAVIOUR.arms()
    keys = [arm.key for arm in arms]
    assert len(keys) == len(set(keys))
    first = keys[:12]
    assert first[:6] == [
        "sft/unregularized@0/seed0",
        "sft/kl@0.3/seed0",
        "sft/isotropic[math]@1/seed0",
        "sft/kfac[math]@1/seed0",
        "sft/kfac[math_t256]@1/seed0",
        "sft/lwf[math]@1/seed0",
    ]
    assert [k.replace("dpo/", "sft/").replace("@0.5/", "@0.3/") for k in first[6:]] == first[:6]
    several = keys[12:30]
    for seed in (0, 1):
        for optimizer in ("sft", "grpo-brevity"):
            for c in (1, 10):
                for label in ("mathsafety_t256", "math_t256"):
                    assert f"{optimizer}/kfac[{label}]@{c:g}/seed{seed}" in keys[:30]
            assert f"{optimizer}/unregularized@0/seed{seed}" in keys[:30]
    assert all("seed1" not in k or k.startswith(("sft/", "grpo-brevity/")) for k in several)
    # every SFT and DPO method at both strengths on seed 1 comes before seed 0's other strengths
    assert keys.index("dpo/lwf[math]@10/seed1") < keys.index("sft/kl@3/seed0")
    assert [a.method for a in arms[-8:]] == ["kfac_summed"] * 8
    assert summed_labels("math+safety_t256") == ["math_t256", "safety_t256"]
    summed = arms[-1]
    assert EMBEDDED_BEHAVIOUR.anchors_of(summed) == {
        "math_kfac_t256",
        "safety_kfac_t256",
        "math_kfac",
        "safety_kfac",
    }
    specs = EMBEDDED_BEHAVIOUR.anchors.anchor_specs()
    assert specs["mathsafety_kfac"].parts == ("math_kfac", "safety_kfac")
    assert specs["mathsafety_kfac_t256"].source == "mathsafety_kfac"
    assert specs["mathsafety_kfac_t256"].rank == 256
