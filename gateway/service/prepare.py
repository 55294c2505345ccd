"""Preparing a request: API input → scheduler request, with nothing submitted and nothing charged.

In order: the model (404 unknown, 403 not allowed); the service tier (403 one the tenant may not
use); the request's one measure against the caps
(gateway/service/sizes.py: 413 for a prompt, tools and tool calls included, that cannot fit the
context or the tenant's `max_prompt_tokens`, token ids counted exactly before any is checked, and
for a schema too large), before anything is templated, tokenized or compiled; the fields (400,
naming the field: sampling, tools, stop strings, max_tokens, speculation within the tenant's
policy); the constraint, compiled; then the prompt or messages (chat template, tools) → token
ids, bounded by the context and `max_prompt_tokens` (413), and max_tokens by the room left (400).
A template that refuses the messages is the client's 400. The result is a `Prepared`: the
`scheduler.request.Request` with its sampling params, stops and drafter.

Deterministic given its input, the tenant, the context and the clock's reading; the one state
kept is the compiled constraints (a cache; gateway/service/constraint.py checks and holds them).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

from gateway import errors, tool_calls
from gateway.errors import ApiError
from gateway.service import fields, sizes
from gateway.service.constraint import ConstraintCheck, GrammarLimits, hold_for
from gateway.service.types import GenerateInput, Prepared, new_request_id
from gateway.tenancy.records import Tenant
from gateway.text import max_token_chars
from scheduler.length_oracle import LengthOracle, prompt_key
from scheduler.request import Request, RequestStats
from workers.prompts import chat_text, check_messages, encode_record

log = logging.getLogger(__name__)


class RequestPreparer:
    def __init__(self, tokenizer: Any, *, models: Sequence[str], stop_token_ids: tuple[int, ...],
                 drafters: Sequence[str], request_id: Callable[[str], str] = new_request_id,
                 length_oracle: LengthOracle | None = None, grammars: Any = None,
                 grammar_limits: GrammarLimits | None = None) -> None:
        """`models`: the ids served; `drafters`: the drafter names this deployment serves;
        `request_id(kind)` names requests ("cmpl", "chatcmpl"); `length_oracle`: measurement
        only, every known prompt's true length as its prediction (scheduler/length_oracle.py);
        `grammars`: the tokenizer's compiled constraints (workers.speculation.grammar.Grammars),
        the worker's own when it runs in this process, so each schema compiles once; None: built
        from the tokenizer at the first constrained request; `grammar_limits`: what a schema may
        ask of the compiler (gateway/service/constraint.py)."""
        self.tokenizer = tokenizer
        self.models = tuple(models)
        self.stop_token_ids = stop_token_ids
        self.drafters = tuple(drafters)
        self.request_id = request_id
        self.length_oracle = length_oracle
        self.vocab_size = len(tokenizer)
        self.constraints = ConstraintCheck(tokenizer, self.vocab_size, stop_token_ids, grammars=grammars,
                                           limits=grammar_limits)
        self.max_token_chars = max_token_chars(tokenizer)
        # whether the chat template writes tools itself, else gateway/tool_calls.py's fallback format
        self.template_tools = tool_calls.template_renders_tools(tokenizer)

    def prepare(self, inp: GenerateInput, tenant: Tenant, *, context: int, now: float) -> Prepared:
        """Every check, then the request (raises ApiError); `context`: the model's context in
        tokens (prompt and output together); `now`: the step loop's clock."""
        if inp.model not in self.models:
            raise errors.unknown_model(inp.model)
        if not tenant.allows_model(inp.model):
            raise errors.forbidden_model(inp.model)
        tier = tenant.tier_for(inp.service_tier)
        if not tenant.allows_tier(tier):
            raise errors.forbidden_tier(tier, tenant.service_tiers)
        sizes.check(sizes.measure(inp), context=context, max_token_chars=self.max_token_chars,
                    max_schema_chars=self.constraints.limits.caps.max_bytes,
                    max_prompt_tokens=tenant.max_prompt_tokens)
        try:
            tool_calls.check_request(inp.tools, inp.tool_choice, inp.parallel_tool_calls)
        except tool_calls.ToolError as exc:
            raise errors.invalid(str(exc), exc.param) from None
        sampling = fields.sampling(inp, self.vocab_size)
        stops = fields.stops(inp.stop)
        asked = fields.max_tokens(inp)
        drafter, max_tree_tokens = fields.speculation(inp, tenant.speculation, self.drafters)
        pin = self.constraints.check(sampling.constraint, tenant.name)   # after the cheap checks
        ids, param, kind = self._tokenize(inp)
        max_new = _output_room(ids, param, asked, tenant, context)
        rid = inp.request_id or self.request_id(kind)
        # the engine's caches go by the tenant's immutable id, never by its name (a name can be
        # removed and given to another tenant): gateway/tenancy/records.py `Tenant`
        stats = RequestStats(rid, tenant.name, now, prompt_len=len(ids), max_tokens=max_new,
                             priority=tenant.priority, max_tree_tokens=max_tree_tokens,
                             tenant_id=tenant.id, tier=tier)
        if self.length_oracle is not None:
            key = prompt_key(messages=inp.messages, prompt=inp.prompt if inp.prompt_ids is None
                             else list(inp.prompt_ids))
            stats.predicted_len = self.length_oracle.length(key, max_new)
        req = Request(stats, prompt_ids=list(ids), sampling=sampling,
                      stop_token_ids=self.stop_token_ids, stop=stops, drafter=drafter,
                      meta={**(inp.meta or {}), **({"detached": True} if inp.detached else {})})
        hold_for(req, pin)              # its grammar stays compiled until its last prefill
        return Prepared(req, tenant, inp.model, stops)

    def _tokenize(self, inp: GenerateInput) -> tuple[list[int], str, str]:
        """(ids, the field they came from, the request kind)."""
        inputs = {"prompt": inp.prompt, "messages": inp.messages, "prompt_ids": inp.prompt_ids}
        given = [k for k, v in inputs.items() if v is not None]
        if len(given) != 1:
            raise ApiError(400, "send exactly one of 'prompt' or 'messages'",
                           param="prompt" if not given else given[1],
                           code="missing_required_parameter" if not given else "invalid_value")
        (field,) = given
        if field == "prompt_ids":
            return self._checked_ids(inp.prompt_ids), "prompt", "cmpl"
        if field == "messages":
            ids = self.tokenizer(self._render(inp), add_special_tokens=False)["input_ids"]
        else:
            try:
                ids = encode_record(self.tokenizer, {"prompt": inp.prompt})
            except ValueError as exc:
                raise errors.invalid(str(exc), field) from None
        if not ids:
            raise errors.invalid("prompt is empty: at least one token is needed", field)
        return ids, field, "chatcmpl" if field == "messages" else "cmpl"

    def _render(self, inp: GenerateInput) -> str:
        """The chat template's text for the messages (and tools). A template that refuses them
        (a role order it does not take, a message it cannot write: Jinja's `raise_exception`, or
        any error inside it) is the client's 400, said in our words: the template's own message
        may quote its source."""
        messages = inp.messages
        with_tools = (isinstance(messages, list) and all(isinstance(m, dict) for m in messages)
                      and tool_calls.uses_tools(messages, inp.tools))
        if not with_tools:
            try:
                check_messages(messages)
            except ValueError as exc:
                raise errors.invalid(str(exc), "messages") from None
        try:
            if with_tools:
                return tool_calls.render_chat(self.tokenizer, messages, inp.tools, inp.tool_choice,
                                              inp.parallel_tool_calls, native=self.template_tools)
            return chat_text(self.tokenizer, messages)
        except Exception:                       # the template refused these messages (jinja)
            log.info("chat template refused a conversation", exc_info=True)
            raise errors.invalid("this model's chat template cannot render these messages"
                                 + (" and tools" if with_tools else "")
                                 + " (check the roles' order and each message's content)",
                                 "messages") from None

    def _checked_ids(self, prompt_ids: Sequence[Any]) -> list[int]:
        ids = list(prompt_ids)
        if not ids:
            raise errors.invalid("prompt is empty: at least one token is needed", "prompt")
        for i, t in enumerate(ids):
            if not fields.is_int(t) or not 0 <= t < self.vocab_size:
                raise errors.invalid(f"token id {t!r} is outside the vocabulary "
                                     f"(0 … {self.vocab_size - 1})", f"prompt.{i}")
        return ids


def _output_room(ids: Sequence[int], param: str, asked: int | None, tenant: Tenant,
                 context: int) -> int:
    """The request's max_tokens, once its prompt is known to fit the context and the tenant's
    `max_prompt_tokens`: what it asked for (400 if more than the room left), else the room."""
    sizes.check_tokens(len(ids), f"{len(ids)} tokens", param, context=context,
                       max_prompt_tokens=tenant.max_prompt_tokens)
    room = context - len(ids)
    if asked is not None and asked > room:
        # NOTE: OpenAI's answer (400), where specgate used to clamp silently: a client that
        # asked for more than fits should know it will not get it.
        raise errors.invalid(f"this model's context is {context} tokens; the request asks for "
                             f"{len(ids) + asked} ({len(ids)} in the {param}, "
                             f"{asked} for the output). Lower max_tokens (or "
                             f"max_completion_tokens) to at most {room}, or shorten the {param}",
                             "max_tokens", code="context_length_exceeded")
    return room if asked is None else asked
