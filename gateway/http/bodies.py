"""OpenAI response bodies, built in one place: plain dicts for the completions and chat APIs,
whole or as stream chunks, with usage, the service tier the request ran in (as OpenAI echoes
it, in the body and in every chunk) and specgate's speculation figures."""
from __future__ import annotations

import time
from typing import Any, Sequence

from gateway import tool_calls
from gateway.service import GenerateOutput, TokenLogprobs


def now_s() -> int:
    return int(time.time())


def usage(outs: Sequence[GenerateOutput]) -> dict[str, int]:
    """Usage of a request's choices, as OpenAI counts it: the prompt once, every choice's
    completion tokens."""
    prompt, completion = outs[0].prompt_tokens, sum(o.completion_tokens for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def spec_stats(outs: Sequence[GenerateOutput]) -> dict[str, Any]:
    """specgate's speculation figures over a request's choices (τ: per step, over all of them)."""
    stats = [o.speculation for o in outs]
    steps = sum(s.steps for s in stats)
    tau = sum(s.tau * s.steps for s in stats) / steps if steps else 0.0
    return {"drafted": sum(s.drafted for s in stats), "accepted": sum(s.accepted for s in stats),
            "steps": steps, "tau": round(tau, 4)}


def completion_logprobs(entries: Sequence[TokenLogprobs] | None) -> dict[str, Any] | None:
    """The legacy completions API's logprobs: parallel lists, `top_logprobs` one {token: logprob}
    per token."""
    if entries is None:
        return None
    return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t: v for t, _, v in e.top} for e in entries],
            "text_offset": [e.offset for e in entries]}


def chat_logprobs(entries: Sequence[TokenLogprobs] | None) -> dict[str, Any] | None:
    """Chat's logprobs: one object per token, with its bytes and its `top_logprobs`."""
    if entries is None:
        return None
    return {"content": [{"token": e.token, "logprob": e.logprob, "bytes": list(e.bytes),
                         "top_logprobs": [{"token": t, "logprob": v, "bytes": list(b)}
                                          for t, b, v in e.top]} for e in entries],
            "refusal": None}


def completion_body(outs: Sequence[GenerateOutput], model: str, created: int) -> dict[str, Any]:
    return {"id": outs[0].request_id, "object": "text_completion", "created": created, "model": model,
            "service_tier": outs[0].service_tier,
            "choices": [{"index": i, "text": out.text, "logprobs": completion_logprobs(out.logprobs),
                         "finish_reason": out.finish_reason} for i, out in enumerate(outs)],
            "usage": usage(outs), "specgate": spec_stats(outs)}


def completion_chunk(rid: str, model: str, created: int, text: str,
                     finish_reason: str | None = None, *, index: int = 0, service_tier: str,
                     logprobs: Sequence[TokenLogprobs] | None = None) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "service_tier": service_tier,
            "choices": [{"index": index, "text": text, "logprobs": completion_logprobs(logprobs),
                         "finish_reason": finish_reason}]}


def chat_body(outs: Sequence[GenerateOutput], model: str, created: int,
              parsers: Sequence[tool_calls.ToolStreamParser | None] = ()) -> dict[str, Any]:
    """With `parsers` (one a choice, for a request with tools), each output is read for calls."""
    choices = []
    for i, out in enumerate(outs):
        parser = parsers[i] if parsers else None
        message: dict[str, Any] = {"role": "assistant", "content": out.text}
        reason = out.finish_reason
        if parser is not None:
            parser.push(out.text)
            parser.finish()
            message["content"] = parser.content
            if parser.calls:
                message["tool_calls"] = [c.as_dict() for c in parser.calls]
                reason = finish_reason(reason, parser)
        choices.append({"index": i, "message": message, "logprobs": chat_logprobs(out.logprobs),
                        "finish_reason": reason})
    return {"id": outs[0].request_id, "object": "chat.completion", "created": created, "model": model,
            "service_tier": outs[0].service_tier, "choices": choices, "usage": usage(outs),
            "specgate": spec_stats(outs)}


def finish_reason(reason: str, parser: tool_calls.ToolStreamParser | None) -> str:
    """"tool_calls" for a generation that ended on its own with calls in it (one cut short by
    max_tokens stays "length", as OpenAI reports it)."""
    return "tool_calls" if parser is not None and parser.calls and reason == "stop" else reason


def chat_chunk(rid: str, model: str, created: int, delta: dict[str, Any],
               finish_reason: str | None = None, *, index: int = 0, service_tier: str,
               logprobs: Sequence[TokenLogprobs] | None = None) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "service_tier": service_tier,
            "choices": [{"index": index, "delta": delta, "logprobs": chat_logprobs(logprobs),
                         "finish_reason": finish_reason}]}
