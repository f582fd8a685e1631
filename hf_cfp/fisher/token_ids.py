"""Turn the prompt forms users have (strings, chat messages, token ids, a Dataset) into token ids."""

import hashlib
import json
from typing import Any

from ..errors import CFPArgumentError


def _is_messages(item) -> bool:
    return isinstance(item, (list, tuple)) and bool(item) and all(isinstance(m, dict) and "role" in m for m in item)


def _is_token_ids(item) -> bool:
    if hasattr(item, "tolist"):  # a tensor or array of ids
        item = item.tolist()
    return isinstance(item, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in item)


def _encode_text(item, tokenizer, is_prompt: bool) -> list[int]:
    """Prompts get the chat template when the tokenizer has one (messages always need it);
    responses are encoded as they are, without special tokens."""
    if tokenizer is None:
        raise CFPArgumentError("Text prompts need a tokenizer; pass one, or pass token-id lists instead.")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if is_prompt and (has_template or not isinstance(item, str)):
        if not has_template:
            raise CFPArgumentError("Chat-message prompts need a tokenizer with a chat_template.")
        messages = [{"role": "user", "content": item}] if isinstance(item, str) else list(item)
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    if not isinstance(item, str):
        raise CFPArgumentError("Responses must be strings or token-id lists, not chat messages.")
    return tokenizer(item, add_special_tokens=is_prompt)["input_ids"]


def to_token_ids(items: Any, tokenizer, what: str = "prompt") -> list[list[int]]:
    """Token ids for each item: strings get the chat template (when the tokenizer has one),
    message lists always do, token-id lists pass through. A Dataset uses its `prompt` column."""
    if hasattr(items, "column_names"):
        if "prompt" not in items.column_names:
            raise CFPArgumentError(f"The dataset has no 'prompt' column (columns: {items.column_names}).")
        items = items["prompt"]
    items = list(items)
    if not items:
        raise CFPArgumentError(f"No {what}s given; pass at least one.")
    encoded = []
    for index, item in enumerate(items):
        if _is_token_ids(item):
            ids = [int(t) for t in (item.tolist() if hasattr(item, "tolist") else item)]
        elif isinstance(item, str) or _is_messages(item):
            ids = _encode_text(item, tokenizer, is_prompt=what == "prompt")
        else:
            raise CFPArgumentError(
                f"{what} {index} is a {type(item).__name__}; use a string, a list of chat messages "
                "({'role': ..., 'content': ...}) or a list of token ids."
            )
        if not ids:
            raise CFPArgumentError(f"{what} {index} is empty after tokenization; remove it.")
        encoded.append(ids)
    return encoded


def prompts_sha256(token_ids: list[list[int]]) -> str:
    """sha256 of the tokenized prompts (after any chat template): identifies the calibration set."""
    return hashlib.sha256(json.dumps(token_ids, separators=(",", ":")).encode()).hexdigest()
