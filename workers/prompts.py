"""A prompt record as token ids: what `specgate generate`, the benches and the gateway all send.

Plain text handling over a tokenizer, kept apart from the runtime so that importing it loads no
torch: a Ray ingress replica and the gateway's request checks tokenize without device code.
"""
from __future__ import annotations

from typing import Any


def encode_record(tokenizer: Any, record: dict) -> list[int]:
    """Token ids for one prompt record: {"prompt": str} as is, {"messages": [...]} through the chat template."""
    if "messages" in record:
        return tokenizer(chat_text(tokenizer, record["messages"]), add_special_tokens=False)["input_ids"]
    if "prompt" in record:
        prompt = record["prompt"]
        if not isinstance(prompt, str):
            raise ValueError("'prompt' must be a string")
        if prompt == "":
            raise ValueError("prompt is empty")
        return tokenizer(prompt)["input_ids"]
    raise ValueError("each record needs a 'prompt' string or a 'messages' list")


def check_messages(messages: Any) -> None:
    """ValueError unless `messages` is what a chat template takes: a non-empty list of
    {role, content} objects with string contents."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list of {role, content} objects")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or "role" not in m:
            raise ValueError("each message needs a 'role' and a string 'content'")


def chat_text(tokenizer: Any, messages: Any) -> str:
    """The prompt text of a conversation: the chat template's, ending where the assistant's turn
    begins. Raises ValueError for malformed messages, and whatever the template raises for ones
    it refuses (a Jinja template's `raise_exception`: roles out of the order it takes)."""
    check_messages(messages)
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
