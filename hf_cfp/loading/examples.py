"""SFT examples from (prompt, response) pairs, as the demo, `hf-cfp diagnose` and the scripts' evidence train
on them."""

import torch


def sft_examples(tokenizer, pairs) -> list[dict]:
    """Chat-formatted (prompt, response) pairs, padded to one length; loss on response tokens only.

    Each row: `input_ids` = the chat template's prompt (generation prompt added) + response + eos, then pad;
    `attention_mask` 1 on the real tokens; `labels` = -100 on the prompt and the padding, the response ids
    (eos included) elsewhere.
    """
    rows = []
    for prompt, response in pairs:
        messages = [{"role": "user", "content": prompt}]
        context = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer(context, add_special_tokens=False)["input_ids"]
        answer_ids = tokenizer(response + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
        rows.append((prompt_ids + answer_ids, [-100] * len(prompt_ids) + answer_ids))
    width = max(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id
    return [
        {
            "input_ids": torch.tensor(ids + [pad] * (width - len(ids))),
            "attention_mask": torch.tensor([1] * len(ids) + [0] * (width - len(ids))),
            "labels": torch.tensor(labels + [-100] * (width - len(labels))),
        }
        for ids, labels in rows
    ]
