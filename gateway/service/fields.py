"""Field checks of a generation request: pure functions of the input (and of the vocabulary
size, the context, the tenant's policy), each refusal an `ApiError` naming the field."""
from __future__ import annotations

from typing import Any

from gateway import errors, tool_calls
from gateway.service.types import GenerateInput
from gateway.tenancy.records import SpeculationPolicy
from workers.contract import MAX_TOP_LOGPROBS, SamplingParams

MAX_STOPS = 16
MAX_STOP_CHARS = 256
MAX_TEMPERATURE = 2.0
MAX_LOGIT_BIAS = 300       # OpenAI's bound on logit_bias entries


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")


def least_tokens(inp: GenerateInput, context: int) -> int:
    """The fewest tokens this request can cost: a one-token prompt, and its max_tokens as far as
    the context allows (what a tenant's limits are prechecked against)."""
    mt = inp.max_tokens
    return context if mt is None else min(1 + mt, context) if is_int(mt) and mt >= 1 else 1


def max_tokens(inp: GenerateInput) -> int | None:
    if inp.max_tokens is not None and (not is_int(inp.max_tokens) or inp.max_tokens < 1):
        raise errors.invalid(f"max_tokens must be an integer >= 1, got {inp.max_tokens!r}",
                             "max_tokens")
    return inp.max_tokens


def sampling(inp: GenerateInput, vocab: int) -> SamplingParams:
    t, p, k = inp.temperature, inp.top_p, inp.top_k
    if not is_number(t) or not 0 <= t <= MAX_TEMPERATURE:
        raise errors.invalid(f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], got {t!r}",
                             "temperature")
    if not is_number(p) or not 0 < p <= 1:
        raise errors.invalid(f"top_p must be a number in (0, 1], got {p!r}", "top_p")
    if not is_int(k) or k < 0:
        raise errors.invalid(f"top_k must be an integer >= 0 (0: off), got {k!r}", "top_k")
    seed = inp.seed
    if seed is not None and (not is_int(seed) or not -(2**63) <= seed < 2**64):
        raise errors.invalid("seed must be a 64-bit integer", "seed")
    for name, v in (("presence_penalty", inp.presence_penalty),
                    ("frequency_penalty", inp.frequency_penalty)):
        if not is_number(v) or not -2 <= v <= 2:
            raise errors.invalid(f"{name} must be a number in [-2, 2], got {v!r}", name)
    lp = inp.logprobs
    if lp is not None and (not is_int(lp) or not 0 <= lp <= MAX_TOP_LOGPROBS):
        raise errors.invalid(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {lp!r}",
                             "top_logprobs")
    return SamplingParams(temperature=float(t), top_k=k, top_p=float(p), seed=seed,
                          presence_penalty=float(inp.presence_penalty),
                          frequency_penalty=float(inp.frequency_penalty),
                          logit_bias=logit_bias(inp.logit_bias, vocab), logprobs=lp,
                          # a forced tool call's schema, else the response_format's
                          constraint=tool_calls.forced_constraint(inp.tools, inp.tool_choice) or inp.constraint)


def logit_bias(bias: Any, vocab: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias` ({"token id": bias in [-100, 100]}, at most 300) as (id, bias)
    pairs in id order; an id outside the vocabulary is the client's mistake, refused (OpenAI
    refuses it too) rather than silently biasing nothing."""
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise errors.invalid("logit_bias must be an object mapping token ids to biases", "logit_bias")
    if len(bias) > MAX_LOGIT_BIAS:
        raise errors.invalid(f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}",
                             "logit_bias")
    out = []
    for key, value in bias.items():
        if not isinstance(key, str) or not key.isascii() or not key.isdigit() or len(key) > 12:
            raise errors.invalid(f"logit_bias keys must be token ids written as strings, got {key!r}",
                                 "logit_bias")
        if int(key) >= vocab:
            raise errors.invalid(f"logit_bias: token id {key} is outside the vocabulary "
                                 f"(0 … {vocab - 1})", "logit_bias")
        if not is_number(value) or not -100 <= value <= 100:
            raise errors.invalid(f"logit_bias values must be numbers in [-100, 100], got {value!r} "
                                 f"for token {key}", "logit_bias")
        out.append((int(key), float(value)))
    return tuple(sorted(out))


def stops(stop: Any) -> tuple[str, ...]:
    given = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(given) > MAX_STOPS:
        raise errors.invalid(f"at most {MAX_STOPS} stop strings, got {len(given)}", "stop")
    for s in given:
        if not isinstance(s, str) or len(s) > MAX_STOP_CHARS:
            raise errors.invalid(f"each stop string must be a string of at most "
                                 f"{MAX_STOP_CHARS} characters", "stop")
    return tuple(s for s in given if s)


def speculation(inp: GenerateInput, policy: SpeculationPolicy,
                served: tuple[str, ...]) -> tuple[str, int | None]:
    """(drafter name, tree cap) within the tenant's policy and the drafters this deployment
    serves (`served`): a request may turn speculation off or shrink its tree, never go past what
    its tenant allows."""
    if inp.speculation not in (None, True, False):
        raise errors.invalid("speculation must be true, false or null", "speculation")
    cap = inp.max_tree_tokens
    if cap is not None and (not is_int(cap) or cap < 0):
        raise errors.invalid(f"max_tree_tokens must be an integer >= 0, got {cap!r}",
                             "speculation.max_tree_tokens")
    drafter = next((d for d in policy.drafters if d in served), None)
    if not policy.enabled or inp.speculation is False or drafter is None:
        return "none", 0
    tenant_cap = policy.max_tree_tokens
    cap = tenant_cap if cap is None else min(cap, tenant_cap)
    return ("none", 0) if cap == 0 else (drafter, cap)
