"""Preparing a request: API input → scheduler request, with nothing submitted and nothing charged.

In order: the model (404 unknown, 403 not allowed), the fields (400, naming the field: sampling,
tools, stop strings, max_tokens, speculation within the tenant's policy), the prompt's length in
characters against what the context and the tenant's `max_prompt_tokens` could hold (413, before
tokenizing), then the prompt or messages (chat template, tools) → token ids, bounded by the
context and `max_prompt_tokens` (413), and max_tokens by the room left (400). The result is a
`Prepared`: the `scheduler.request.Request` with its sampling params, stops and drafter.

Deterministic given its input, the tenant, the context and the clock's reading; the one state
kept is the compiled constraints (a cache; gateway/service/constraint.py checks and holds them).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

from gateway import errors, tool_calls
from gateway.errors import ApiError
from gateway.service import fields
from gateway.service.constraint import ConstraintCheck, GrammarLimits, hold_for
from gateway.service.types import GenerateInput, Prepared, new_request_id
from gateway.tenancy.records import Tenant
from gateway.text import max_token_chars
from scheduler.length_oracle import LengthOracle, prompt_key
from scheduler.request import Request, RequestStats
from workers.prompts import encode_record

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
        try:
            tool_calls.check_request(inp.tools, inp.tool_choice, inp.parallel_tool_calls)
        except tool_calls.ToolError as exc:
            raise errors.invalid(str(exc), exc.param) from None
        sampling = fields.sampling(inp, self.vocab_size)
        pin = self.constraints.check(sampling.constraint, tenant.name)
        stops = fields.stops(inp.stop)
        asked = fields.max_tokens(inp)
        drafter, max_tree_tokens = fields.speculation(inp, tenant.speculation, self.drafters)
        self._check_prompt_chars(inp, tenant, context)
        ids, param, kind = self._tokenize(inp)
        max_new = _output_room(ids, param, asked, tenant, context)
        rid = inp.request_id or self.request_id(kind)
        # the engine's caches go by the tenant's immutable id, never by its name (a name can be
        # removed and given to another tenant): gateway/tenancy/records.py `Tenant`
        stats = RequestStats(rid, tenant.name, now, prompt_len=len(ids), max_tokens=max_new,
                             priority=tenant.priority, max_tree_tokens=max_tree_tokens,
                             tenant_id=tenant.id)
        if self.length_oracle is not None:
            key = prompt_key(messages=inp.messages, prompt=inp.prompt if inp.prompt_ids is None
                             else list(inp.prompt_ids))
            stats.predicted_len = self.length_oracle.length(key, max_new)
        req = Request(stats, prompt_ids=list(ids), sampling=sampling,
                      stop_token_ids=self.stop_token_ids, stop=stops, drafter=drafter,
                      meta={**(inp.meta or {}), **({"detached": True} if inp.detached else {})})
        hold_for(req, pin)              # its grammar stays compiled until its last prefill
        return Prepared(req, tenant, inp.model, stops)

    def _check_prompt_chars(self, inp: GenerateInput, tenant: Tenant, context: int) -> None:
        """Refuse, before tokenizing it, a prompt whose characters need more tokens than the
        context (or the tenant's `max_prompt_tokens`) holds, however it tokenizes: every token
        stands for at most `max_token_chars` characters (gateway/text.py)."""
        text = fields.prompt_chars(inp)
        if text is None:
            return                     # token ids: counted exactly, and cheaply, later; or malformed
        field, chars = text
        at_least = -(-chars // self.max_token_chars)   # ceil
        if at_least >= context:
            raise errors.too_large(f"the prompt has at least {at_least} tokens; this model's "
                                   f"context is {context} tokens (prompt and output together)",
                                   field, code="context_length_exceeded")
        cap = tenant.max_prompt_tokens
        if cap is not None and at_least > cap:
            raise errors.too_large(f"the prompt has at least {at_least} tokens; this API key may "
                                   f"send at most {cap}", field, code="max_prompt_tokens_exceeded")

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
        if field == "messages" and isinstance(inp.messages, list) and tool_calls.uses_tools(
                inp.messages, inp.tools):
            ids = self._encode_with_tools(inp)
        else:
            try:
                ids = encode_record(self.tokenizer, {field: inputs[field]})
            except ValueError as exc:
                raise errors.invalid(str(exc), field) from None
        if not ids:
            raise errors.invalid("prompt is empty: at least one token is needed", field)
        return ids, field, "chatcmpl" if field == "messages" else "cmpl"

    def _checked_ids(self, prompt_ids: Sequence[Any]) -> list[int]:
        ids = list(prompt_ids)
        if not ids:
            raise errors.invalid("prompt is empty: at least one token is needed", "prompt")
        for i, t in enumerate(ids):
            if not fields.is_int(t) or not 0 <= t < self.vocab_size:
                raise errors.invalid(f"token id {t!r} is outside the vocabulary "
                                     f"(0 … {self.vocab_size - 1})", f"prompt.{i}")
        return ids

    def _encode_with_tools(self, inp: GenerateInput) -> list[int]:
        try:
            text = tool_calls.render_chat(self.tokenizer, inp.messages, inp.tools, inp.tool_choice,
                                          inp.parallel_tool_calls, native=self.template_tools)
        except Exception:                       # the template refused these messages (jinja)
            log.info("chat template refused a conversation with tools", exc_info=True)
            raise errors.invalid("this model's chat template cannot render these messages "
                                 "and tools", "messages") from None
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


def _output_room(ids: Sequence[int], param: str, asked: int | None, tenant: Tenant,
                 context: int) -> int:
    """The request's max_tokens, once its prompt is known to fit the context and the tenant's
    `max_prompt_tokens`: what it asked for (400 if more than the room left), else the room."""
    if len(ids) >= context:
        raise errors.too_large(f"the prompt has {len(ids)} tokens; this model's context is "
                               f"{context} tokens (prompt and output together)", param,
                               code="context_length_exceeded")
    cap = tenant.max_prompt_tokens
    if cap is not None and len(ids) > cap:
        raise errors.too_large(f"the prompt has {len(ids)} tokens; this API key may send at "
                               f"most {cap}", param, code="max_prompt_tokens_exceeded")
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
