"""What the attacker sends: each hostile pattern's request, built as plain bytes or dicts.

Pure functions, no I/O, so each can be checked for what it claims (tests/unit/test_hostile.py):
the tools bomb's body sits between 1.5 MiB and the 2 MiB body cap, the schema bomb's arrays
span 50 to 400 items, the byte token decodes alone to U+FFFD, a gRPC prompt has the size asked.

A body sent many times is built once with a marker (`Spliced`) and given a fresh nonce per
request by joining bytes, not by encoding megabytes of JSON again: the client must not be what
the load test measures, and each request must still differ so that no cache answers it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

MIB = 1024 * 1024
REPLACEMENT = "\ufffd"
NONCE = "@@NONCE@@"                    # the marker `Spliced` replaces; never in a real body
FILLER = "the tool reads the ledger, checks each entry twice and reports what it found. "
# the schema bomb's twelve arrays: item counts spread between 50 and 400
ARRAY_COUNTS = (50, 80, 110, 140, 170, 200, 230, 260, 290, 320, 360, 400)
# a string pattern with bounded repeats: each bound unrolls into states when compiled
ITEM_PATTERN = r"^[a-z]{2,12}(-[a-z0-9]{1,8}){0,6}(\.[a-z]{2,4}){1,3}$"


@dataclass(frozen=True)
class Spliced:
    """A JSON body with one `NONCE` marker, split around it: `with_nonce(7)` is the body with
    "7" in the marker's place (inside a string, so any digits keep it valid JSON)."""
    head: bytes
    tail: bytes

    @classmethod
    def of(cls, body: dict[str, Any]) -> "Spliced":
        raw = json.dumps(body, separators=(",", ":")).encode()
        head, sep, tail = raw.partition(NONCE.encode())
        if not sep or NONCE.encode() in tail:
            raise ValueError("a spliced body needs exactly one nonce marker")
        return cls(head, tail)

    def with_nonce(self, n: int) -> bytes:
        return self.head + str(n).encode() + self.tail

    def __len__(self) -> int:
        return len(self.head) + len(self.tail)


def filler(chars: int, salt: int = 0) -> str:
    """`chars` characters of plain English, starting at a different word for each `salt`."""
    start = (salt * 7) % len(FILLER)
    text = FILLER[start:] + FILLER * (chars // len(FILLER) + 2)
    return text[:chars]


def chat_body(model: str, content: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0, **extra}


# ---- 1. tools bomb -----------------------------------------------------------------------------
def tools_bomb(model: str, tools: int = 28, description_chars: int = 60_000) -> Spliced:
    """A chat request carrying `tools` function tools whose descriptions are
    `description_chars` long each (28 × 60 000: about 1.6 MiB, under the 2 MiB body cap)."""
    defs = [{"type": "function", "function": {
        "name": f"lookup_{i}", "description": filler(description_chars, i),
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                       "required": ["query"]}}} for i in range(tools)]
    return Spliced.of(chat_body(model, f"Look up entry {NONCE}.", 1, tools=defs))


# ---- 2. schema bomb ----------------------------------------------------------------------------
def bomb_schema(description: str, counts: Sequence[int] = ARRAY_COUNTS,
                pattern: str = ITEM_PATTERN) -> dict[str, Any]:
    """Twelve array properties whose exact item counts (minItems = maxItems) run from 50 to 400,
    each item a string held to `pattern`; schemas that differ only in `description` compile
    alike, but each is a new cache key."""
    props = {f"list_{i}": {"type": "array", "minItems": n, "maxItems": n,
                           "items": {"type": "string", "pattern": pattern}}
             for i, n in enumerate(counts)}
    return {"type": "object", "description": description, "properties": props,
            "required": list(props), "additionalProperties": False}


def schema_bomb(model: str) -> Spliced:
    """A chat request with `response_format` json_schema: the bomb schema, a nonce in its
    description so that no compiled-schema cache helps."""
    fmt = {"type": "json_schema", "json_schema": {
        "name": "ledger", "strict": True, "schema": bomb_schema(f"ledger variant {NONCE}")}}
    return Spliced.of(chat_body(model, "Fill in the ledger.", 16, response_format=fmt))


# ---- 3. byte-token output ----------------------------------------------------------------------
def byte_token_ids(tokenizer: Any, limit: int = 8) -> list[int]:
    """Up to `limit` token ids that decode alone to U+FFFD: byte-level tokens holding part of a
    UTF-8 character (none in a tokenizer without such tokens)."""
    found = []
    for i in range(len(tokenizer)):
        if tokenizer.decode([i]) == REPLACEMENT:
            found.append(i)
            if len(found) == limit:
                break
    return found


def byte_stream(model: str, token_id: int, max_tokens: int) -> Spliced:
    """A resumable streamed chat whose every output token is `token_id` (logit_bias +100):
    a long run of bytes that never complete a character, kept for resumes."""
    return Spliced.of(chat_body(
        model, f"Say anything ({NONCE}).", max_tokens, stream=True,
        logit_bias={str(token_id): 100},
        stream_options={"resumable": True, "include_usage": True}))


# ---- the reference: an ordinary busy neighbour ---------------------------------------------------
def busy_stream(model: str, max_tokens: int = 128) -> Spliced:
    """An ordinary streamed chat, what any legitimate neighbour sends: `concurrency` of them at
    once keep the batch full, which is what sharing the verifier costs a victim at best."""
    return Spliced.of(chat_body(model, f"Tell me a story about a harbour ({NONCE}).", max_tokens,
                                stream=True))


# ---- 4. stored responses, 5. followers ---------------------------------------------------------
def stored_response(model: str, max_output_tokens: int = 2) -> Spliced:
    """A small stored background response (Responses API): each one is kept by the gateway."""
    return Spliced.of({"model": model, "input": f"Note {NONCE}: ok.", "store": True,
                       "background": True, "max_output_tokens": max_output_tokens})


def long_response(model: str, max_output_tokens: int) -> dict[str, Any]:
    """A long background response for followers to follow."""
    return {"model": model, "input": "Write a long story about a lighthouse keeper.",
            "background": True, "store": True, "max_output_tokens": max_output_tokens}


def long_chat_stream(model: str, max_tokens: int) -> dict[str, Any]:
    """A long resumable chat stream for followers to resume."""
    return chat_body(model, "Write a long story about a lighthouse keeper.", max_tokens,
                     stream=True, stream_options={"resumable": True})


# ---- 6. large gRPC messages --------------------------------------------------------------------
# around the HTTP body cap (2 MiB) and gRPC's own default receive limit (4 MiB)
GRPC_PROMPT_BYTES = (int(1.9 * MIB), int(2.5 * MIB), int(3.9 * MIB), int(4.5 * MIB))


def grpc_prompt(size: int, salt: int = 0) -> str:
    """An ASCII prompt of exactly `size` bytes."""
    return f"{salt} " + filler(size - len(f"{salt} "), salt)


# ---- 7. idle streams ---------------------------------------------------------------------------
def http_request(method: str, path: str, host: str, key: str, body: bytes = b"") -> bytes:
    """One raw HTTP/1.1 request (for a socket the attacker never reads)."""
    head = (f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


def idle_stream(model: str, host: str, key: str, max_tokens: int, n: int) -> bytes:
    """A streamed chat asking for `max_tokens`, as raw bytes: sent, then never read."""
    body = chat_body(model, f"Write a long story ({n}).", max_tokens, stream=True)
    return http_request("POST", "/v1/chat/completions", host, key, json.dumps(body).encode())
