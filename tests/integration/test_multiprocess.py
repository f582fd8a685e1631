"""`hf-cfp estimate` on 2 CPU processes (torchrun, gloo) gives the single-process anchor."""

from pathlib import Path

import pytest
import torch
from support.tiny import tiny_llama, tiny_tokenizer, torchrun

from hf_cfp import FisherAnchor, estimate_fisher
from hf_cfp.loading.models import load_causal_lm

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "compute_fisher.py"


def test_two_processes_give_the_single_process_anchor(tmp_path):
    model_dir = tmp_path / "model"
    tokenizer = tiny_tokenizer()
    tiny_llama(vocab_size=len(tokenizer), hidden_size=16, eos_token_id=tokenizer.eos_token_id).save_pretrained(
        model_dir
    )
    tokenizer.save_pretrained(model_dir)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("two plus three\nwhat is the answer\nprint the sum\n")
    options = ["--num-sequences", "10", "--batch-size", "3", "--max-new-tokens", "5", "--seed", "4", "--name", "math"]
    run = torchrun(SCRIPT, "--model", model_dir, "--prompts", prompts, "--output", tmp_path / "two", *options)
    assert run.returncode == 0, run.stderr[-3000:]
    two = FisherAnchor.from_pretrained(tmp_path / "two")
    assert two.metadata["num_processes"] == 2

    model, tokenizer = load_causal_lm(str(model_dir))
    one = estimate_fisher(
        model,
        tokenizer,
        prompts.read_text().splitlines(),
        num_sequences=10,
        batch_size=3,
        max_new_tokens=5,
        seed=4,
        name="math",
        show_progress=False,
    )
    assert one.metadata["num_processes"] == 1
    assert one.metadata["prompts_sha256"] == two.metadata["prompts_sha256"]
    assert one.metadata["mean_response_tokens"] == two.metadata["mean_response_tokens"]  # the same draws
    for name, tensor in one.fisher.items():
        torch.testing.assert_close(two.fisher[name], tensor, rtol=1e-5, atol=1e-7 * float(tensor.max()))
    # the split-half sums are added across processes too (batch 1 of 3 sequences straddles n = 5)
    split_one, split_two = one.metadata["split_half"], two.metadata["split_half"]
    assert split_one["num_sequences"] == split_two["num_sequences"] == [5, 5]
    assert split_one["top1pct_overlap"] == split_two["top1pct_overlap"]
    assert split_two["mass_relative_difference"] == pytest.approx(split_one["mass_relative_difference"], rel=1e-4)
