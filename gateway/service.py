"""The generation service: what REST and gRPC both call. No HTTP in here.

One request, in order:
    precheck  the tenant's rate limits as they stand (429 with Retry-After), before any work on
              its prompt: a tenant over its limits costs no tokenization;
    check     the model (404 unknown, 403 not allowed), the fields (400, naming the field), the
              prompt's length in characters against what the context and the tenant's
              `max_prompt_tokens` could hold (413, before tokenizing);
    tokenize  prompt or messages (chat template) → ids; the context and the tenant's
              `max_prompt_tokens` bound the prompt (413);
    limit     the tenant's rate and token limits, charged (429 with Retry-After; 400 for a
              request larger than the tenant's whole TPM, which waiting cannot help);
    submit    to the step loop, with the tenant's priority, weight and speculation policy
              (a full queue: 429 for the tenant's own queue, 503 for the scheduler's);
    stream    the loop's events, bridged from its thread into asyncio, through the incremental
              detokenizer and the stop-string matcher; a stop string ends the request early.

`open_stream()` does precheck … submit in a worker thread: a 2 MB prompt takes about a second to
tokenize, and the limiter's and the state store's calls (`submit` persists the request) may wait
on the network, up to the store's timeout; none may hold up the event loop, which serves every
other stream and /health. `stream()` is the same, on the calling thread.
A concurrency grant is kept by `gateway.tenancy.grants.GrantKeeper`: renewed while the request
runs, released (off the event loop, retried if the store does not answer) however it ends.
Both admit eagerly: they raise `ApiError` before returning, so a caller can still answer
with an error status; the iterator it returns yields `StreamChunk`s then one `GenerateOutput`.
Closing it early (`aclose()`, a client gone) cancels the request and frees its KV within a step,
unless the request is detached (a background response, a resumable chat stream): then it runs to
its end with nobody listening (`adopt`), and readers follow it from the state store.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import time
import uuid
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Iterable, Protocol, Sequence

from gateway import errors, tool_calls
from gateway.errors import ApiError
from gateway.metrics import GatewayMetrics
from gateway.tenancy.grants import GrantKeeper
from gateway.tenancy.records import SpeculationPolicy, Tenant
from gateway.text import IncrementalDetokenizer, OutputText, max_token_chars, token_piece
from scheduler.admission import ADMITTED
from scheduler.length_oracle import LengthOracle, prompt_key
from scheduler.loop import Delta, Finished, StepLoop
from scheduler.request import Request, RequestStats, Status
from workers.contract import MAX_TOP_LOGPROBS, SamplingParams, TokenLogprob
from workers.prompts import encode_record

if TYPE_CHECKING:
    from gateway.tenancy.limits import Grant, Limiter

log = logging.getLogger(__name__)

MAX_STOPS = 16
INLINE_CHARS = 16_384      # prompts up to this size are tokenized on the event loop (`_quick`)
MAX_STOP_CHARS = 256
MAX_TEMPERATURE = 2.0
MAX_LOGIT_BIAS = 300       # OpenAI's bound on logit_bias entries


@dataclass(frozen=True)
class GenerateInput:
    tenant: Tenant | None               # None: not authenticated (refused with 401)
    model: str
    prompt: str | None = None           # completions
    messages: list[dict] | None = None  # chat (chat template applied)
    max_tokens: int | None = None       # None: up to the context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    speculation: bool | None = None     # per-request switch (None: tenant default)
    max_tree_tokens: int | None = None  # per-request cap, bounded by the tenant's
    user: str | None = None
    prompt_ids: tuple[int, ...] | None = None   # completions given token ids instead of text
    tools: tuple[dict, ...] | None = None       # chat: OpenAI function tools (gateway/tool_calls.py)
    tool_choice: str | dict | None = None       # "none", "auto", "required" or a named function
    parallel_tool_calls: bool | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Any = None              # {"token id": bias}, as OpenAI takes it; None: none
    logprobs: int | None = None         # None: off; k: each token's logprob and its top k
    constraint: str | None = None       # SamplingParams.constraint (chat's response_format)
    request_id: str | None = None       # the id to give it (a response's id); None: a new one
    # runs whether or not anyone listens (a background response, `open_detached`): closing its
    # stream does not cancel it, and a restarted gateway finishes it instead of cancelling it
    detached: bool = False
    # kept with the request's record (`Request.meta`) for whoever reads it back: e.g. what a
    # chat stream's resume needs to render its chunks as the live stream did (gateway/replay.py)
    meta: dict | None = None


@dataclass(frozen=True)
class SpecStats:
    drafted: int        # draft tokens verified (tree nodes), rejected ones included
    accepted: int       # draft tokens the target agreed with
    steps: int          # verification steps the request was in
    tau: float          # mean tokens committed per step (accepted + 1)

    @classmethod
    def of(cls, s: RequestStats) -> "SpecStats":
        """A request's speculation, from its final stats."""
        return cls(drafted=max(0, s.attained - s.n_steps), accepted=s.accepted_sum,
                   steps=s.n_steps, tau=(s.tau_sum / s.n_steps) if s.n_steps else 0.0)


@dataclass(frozen=True)
class TokenLogprobs:
    """One output token as a client's logprobs show it (rendered here, where the tokenizer is)."""
    token: str                      # its text, decoded alone
    bytes: tuple[int, ...]          # its bytes (gateway/text.py `token_piece`)
    logprob: float
    top: tuple[tuple[str, tuple[int, ...], float], ...]   # (token, bytes, logprob), likeliest first
    offset: int                     # where its text starts in the output text (characters)


@dataclass(frozen=True)
class StreamChunk:
    text: str                       # new text, safe to show (no stop string, no half character)
    token_ids: tuple[int, ...]      # tokens committed since the previous chunk
    # the logprobs of the tokens whose text this chunk completes (when asked for): a token's
    # entry goes out with the chunk that shows where its text starts
    logprobs: tuple[TokenLogprobs, ...] | None = None


@dataclass(frozen=True)
class GenerateOutput:
    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    speculation: SpecStats
    logprobs: tuple[TokenLogprobs, ...] | None = None   # of the tokens whose text is in `text`


class EventStream(Protocol):
    """What `open_stream` returns: `RequestStream` here, `gateway.ray_serve.remote.RemoteStream`
    in a Ray ingress; `StreamChunk`s, then one `GenerateOutput`."""
    request_id: str

    def __aiter__(self) -> AsyncIterator[StreamChunk | GenerateOutput]: ...

    async def aclose(self) -> None: ...


@dataclass(frozen=True)
class _Prepared:
    """A request that passed every check and is ready to submit."""
    request: Request
    tenant: Tenant
    model: str
    stops: tuple[str, ...]


def new_request_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex}"


class GenerationService:
    def __init__(self, step_loop: StepLoop, tokenizer: Any, *, models: Sequence[str],
                 limiter: Limiter | None = None, metrics: GatewayMetrics | None = None,
                 stop_token_ids: Iterable[int] = (), drafters: Sequence[str] = ("ngram",),
                 ready_checks: Sequence[Callable[[], bool]] = (),
                 request_id: Callable[[str], str] = new_request_id,
                 length_oracle: LengthOracle | None = None, grammars: Any = None):
        """`models`: the ids served (the first is the target); `drafters`: the drafter names this
        deployment serves (a tenant's policy picks among them); `ready_checks`: each must return
        True (and not raise) for `ready()`; `request_id(kind)` names requests ("cmpl", "chatcmpl");
        `length_oracle`: measurement only, every known prompt's true length as its prediction
        (scheduler/length_oracle.py); `grammars`: the tokenizer's compiled constraints
        (workers.speculation.grammar.Grammars), the worker's own when it runs in this process, so each schema
        compiles once; None: built from the tokenizer at the first constrained request."""
        if not models:
            raise ValueError("a service needs at least one model id")
        self.step_loop = step_loop
        self.tokenizer = tokenizer
        self.models = list(models)
        self.limiter = limiter
        self.grants = GrantKeeper(limiter) if limiter is not None else None
        self.metrics = metrics if metrics is not None else GatewayMetrics()
        self.stop_token_ids = tuple(sorted(stop_token_ids))
        self.drafters = tuple(drafters)
        self.ready_checks = tuple(ready_checks)
        self.request_id = request_id
        self.length_oracle = length_oracle
        self._grammars = grammars
        # tenant id -> name, of every tenant this service has submitted for: what `sweep_tenants`
        # checks against the store (a few dozen bytes a tenant)
        self._tenants_seen: dict[str, str] = {}
        self.vocab_size = len(tokenizer)
        self.max_token_chars = max_token_chars(tokenizer)
        # whether the chat template writes tools itself, else gateway/tool_calls.py's fallback format
        self.template_tools = tool_calls.template_renders_tools(tokenizer)
        self.started_s = int(time.time())      # the models' "created" time
        # detached requests (`open_detached`): their draining tasks, and who hears they ended
        self._detached: set[asyncio.Task] = set()
        self.detached_ended: list[Callable[[str], None]] = []
        # recovered requests' ends are settled here (gateway/takeover.py): Redis calls, off the loop
        self.orphans = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="specgate-orphans")

    # ---- the interface ------------------------------------------------------------------------
    def ready(self) -> bool:
        for check in self.ready_checks:
            try:
                if not check():
                    return False
            except Exception:                          # an unreachable store is "not ready"
                return False
        return True

    async def generate(self, inp: GenerateInput) -> GenerateOutput:
        stream = await self.open_stream(inp)
        try:
            async for item in stream:
                if isinstance(item, GenerateOutput):
                    if item.finish_reason == "error":
                        raise ApiError(500, "generation failed; retry the request",
                                       code="generation_failed")
                    return item
        finally:
            await stream.aclose()
        raise AssertionError("a stream ends with its GenerateOutput")

    async def open_stream(self, inp: GenerateInput) -> "RequestStream":
        """`stream`, awaitable, with the checks, tokenization and the limiter off the event loop
        (module docstring): the call the routers make, so a remote service (Ray mode's
        `gateway.ray_serve.remote.RemoteService`) can admit the request over the network first."""
        t0 = time.perf_counter()
        if inp.tenant is None:
            raise errors.unauthorized()
        aio = asyncio.get_running_loop()
        if self._quick(inp):
            return self._open(inp, inp.tenant, aio, t0)
        return await asyncio.to_thread(self._open, inp, inp.tenant, aio, t0)

    def _open(self, inp: GenerateInput, tenant: Tenant, aio: asyncio.AbstractEventLoop,
              t0: float) -> "RequestStream":
        prep, grant = self._admit(inp, tenant)
        return self._submit_or_release(prep, grant, aio, t0)

    def _quick(self, inp: GenerateInput) -> bool:
        """Admit on the event loop itself? Only when nothing can take long: a short prompt (a
        thread hop costs more than tokenizing it), and no limiter or state store across the
        network."""
        if (self.limiter is not None and self.limiter.remote) or self.step_loop.store.remote:
            return False
        if inp.constraint is not None:
            return False                # compiling a schema may take milliseconds (a cache miss)
        if inp.prompt_ids is not None:
            return len(inp.prompt_ids) <= INLINE_CHARS
        text = _prompt_chars(inp)
        return text is None or text[1] <= INLINE_CHARS

    def stream(self, inp: GenerateInput) -> "RequestStream":
        """Admit the request (raises ApiError) and return its event iterator. Call it on the
        event loop that will iterate it (the loop's thread posts events there)."""
        t0 = time.perf_counter()
        if inp.tenant is None:
            raise errors.unauthorized()
        return self._open(inp, inp.tenant, asyncio.get_running_loop(), t0)

    def _admit(self, inp: GenerateInput, tenant: Tenant) -> tuple[_Prepared, Grant | None]:
        """precheck, check, tokenize, limit (module docstring): any thread."""
        self._precheck(inp, tenant)
        try:
            prep = self._prepare(inp, tenant)
        except ApiError:
            self.metrics.rejected(tenant.name)
            raise
        return prep, self._acquire(prep)

    def _submit_or_release(self, prep: _Prepared, grant: Grant | None,
                           aio: asyncio.AbstractEventLoop, t0: float) -> "RequestStream":
        try:
            stream = self._submit(prep, grant, aio, t0)
        except BaseException:
            if self.grants is not None and grant is not None:
                self.grants.release(grant, 0)         # refused after acquire: retried if it fails
            raise
        if self.grants is not None and grant is not None:
            self.grants.hold(grant)                   # renewed while the request runs
        return stream

    async def open_detached(self, inp: GenerateInput) -> str:
        """Admit a request that runs to its end whether or not anyone listens (a background
        response): refusals raise ApiError as `open_stream`'s do; returns its id. Readers follow
        it from the state store (gateway/responses). When it ends, each of `detached_ended` is
        called with its id, on a worker thread."""
        if not inp.detached:
            inp = replace(inp, detached=True)
        stream = await self.open_stream(inp)
        self.adopt(stream)
        return stream.request_id

    def adopt(self, stream: "RequestStream") -> None:
        """Run a detached request's stream to its end with nobody listening (its grant released
        and `detached_ended` told when it ends): what `open_detached` does at once, and what a
        resumable chat stream's `close` does when its client goes away. The event loop's."""
        task = asyncio.get_running_loop().create_task(self._drain(stream))
        self._detached.add(task)
        task.add_done_callback(self._detached.discard)

    async def _drain(self, stream: "RequestStream") -> None:
        try:
            async for _ in stream:
                pass
        finally:
            await stream.aclose()
        await asyncio.to_thread(self.tell_detached_ended, stream.request_id)

    def tell_detached_ended(self, request_id: str) -> None:
        for hear in self.detached_ended:
            try:
                hear(request_id)
            except Exception:
                log.exception("a listener of detached request %s failed", request_id)

    def cancel(self, request_id: str) -> None:
        """End a request at the next step boundary (a client's explicit cancel)."""
        self.step_loop.cancel(request_id)

    def take_over(self, request_ids: Iterable[str]) -> list[str]:
        """Look after requests a restarted step loop recovered (gateway/takeover.py): detached
        ones run on, the others are cancelled; usage corrected either way. Returns the ids
        cancelled."""
        from gateway.takeover import take_over
        return take_over(self, request_ids)

    # ---- check and tokenize ---------------------------------------------------------------------
    def _prepare(self, inp: GenerateInput, tenant: Tenant) -> _Prepared:
        if inp.model not in self.models:
            raise errors.unknown_model(inp.model)
        if not tenant.allows_model(inp.model):
            raise errors.forbidden_model(inp.model)
        try:
            tool_calls.check_request(inp.tools, inp.tool_choice, inp.parallel_tool_calls)
        except tool_calls.ToolError as exc:
            raise errors.invalid(str(exc), exc.param) from None
        sampling = _sampling(inp, self.vocab_size)
        self._check_constraint(sampling.constraint)
        stops = _stops(inp.stop)
        if inp.max_tokens is not None and (not _is_int(inp.max_tokens) or inp.max_tokens < 1):
            raise errors.invalid(f"max_tokens must be an integer >= 1, got {inp.max_tokens!r}",
                                 "max_tokens")
        drafter, max_tree_tokens = self._speculation(inp, tenant.speculation)
        limit = self.step_loop.worker.context_limit
        self._check_prompt_chars(inp, tenant, limit)
        ids, param, kind = self._tokenize(inp)
        if len(ids) >= limit:
            raise errors.too_large(f"the prompt has {len(ids)} tokens; this model's context is "
                                   f"{limit} tokens (prompt and output together)", param,
                                   code="context_length_exceeded")
        cap = tenant.max_prompt_tokens
        if cap is not None and len(ids) > cap:
            raise errors.too_large(f"the prompt has {len(ids)} tokens; this API key may send at "
                                   f"most {cap}", param, code="max_prompt_tokens_exceeded")
        room = limit - len(ids)
        if inp.max_tokens is not None and inp.max_tokens > room:
            # NOTE: OpenAI's answer (400), where specgate used to clamp silently: a client that
            # asked for more than fits should know it will not get it.
            raise errors.invalid(f"this model's context is {limit} tokens; the request asks for "
                                 f"{len(ids) + inp.max_tokens} ({len(ids)} in the {param}, "
                                 f"{inp.max_tokens} for the output). Lower max_tokens (or "
                                 f"max_completion_tokens) to at most {room}, or shorten the {param}",
                                 "max_tokens", code="context_length_exceeded")
        max_new = room if inp.max_tokens is None else inp.max_tokens
        rid = inp.request_id or self.request_id(kind)
        # the engine's caches go by the tenant's immutable id, never by its name (a name can be
        # removed and given to another tenant): gateway/tenancy/records.py `Tenant`
        stats = RequestStats(rid, tenant.name, self.step_loop.clock(), prompt_len=len(ids),
                             max_tokens=max_new, priority=tenant.priority,
                             max_tree_tokens=max_tree_tokens, tenant_id=tenant.id)
        if self.length_oracle is not None:
            key = prompt_key(messages=inp.messages, prompt=inp.prompt if inp.prompt_ids is None
                             else list(inp.prompt_ids))
            stats.predicted_len = self.length_oracle.length(key, max_new)
        req = Request(stats, prompt_ids=list(ids), sampling=sampling,
                      stop_token_ids=self.stop_token_ids, stop=stops, drafter=drafter,
                      meta={**(inp.meta or {}), **({"detached": True} if inp.detached else {})})
        return _Prepared(req, tenant, inp.model, stops)

    def _check_constraint(self, constraint: str | None) -> None:
        """Compile a request's constraint here (cached), so that a schema the grammar engine
        refuses is a 400 naming response_format, never an error inside the step loop."""
        if constraint is None:
            return
        from workers.speculation.grammar import ConstraintError, Grammars

        if self._grammars is None:
            try:
                self._grammars = Grammars.from_tokenizer(self.tokenizer, self.vocab_size, self.stop_token_ids)
            except ValueError:
                raise errors.invalid("this deployment serves no structured outputs (its model has no "
                                     "stop token)", "response_format") from None
        try:
            self._grammars.compiled(constraint)
        except ConstraintError as e:
            raise errors.invalid(f"response_format: {e}", "response_format") from None
        except Exception:            # a tokenizer the engine cannot read (the fake worker's)
            log.exception("compiling a constraint failed")
            raise errors.invalid("this deployment cannot serve structured outputs",
                                 "response_format") from None

    def _check_prompt_chars(self, inp: GenerateInput, tenant: Tenant, context: int) -> None:
        """Refuse, before tokenizing it, a prompt whose characters need more tokens than the
        context (or the tenant's `max_prompt_tokens`) holds, however it tokenizes: every token
        stands for at most `max_token_chars` characters (gateway/text.py)."""
        if inp.prompt_ids is not None:
            return                                     # counted exactly, and cheaply, later
        text = _prompt_chars(inp)
        if text is None:
            return                                     # malformed: `_tokenize` says how
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
        inputs = {"prompt": inp.prompt, "messages": inp.messages, "prompt_ids": inp.prompt_ids}
        given = [k for k, v in inputs.items() if v is not None]
        if len(given) != 1:
            raise ApiError(400, "send exactly one of 'prompt' or 'messages'",
                           param="prompt" if not given else given[1],
                           code="missing_required_parameter" if not given else "invalid_value")
        (field,) = given
        if field == "prompt_ids":
            ids = list(inp.prompt_ids)
            if not ids:
                raise errors.invalid("prompt is empty: at least one token is needed", "prompt")
            for i, t in enumerate(ids):
                if not _is_int(t) or not 0 <= t < self.vocab_size:
                    raise errors.invalid(f"token id {t!r} is outside the vocabulary "
                                         f"(0 … {self.vocab_size - 1})", f"prompt.{i}")
            return ids, "prompt", "cmpl"
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

    def _encode_with_tools(self, inp: GenerateInput) -> list[int]:
        try:
            text = tool_calls.render_chat(self.tokenizer, inp.messages, inp.tools, inp.tool_choice,
                                     inp.parallel_tool_calls, native=self.template_tools)
        except Exception:                       # the template refused these messages (jinja)
            log.info("chat template refused a conversation with tools", exc_info=True)
            raise errors.invalid("this model's chat template cannot render these messages "
                                 "and tools", "messages") from None
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _speculation(self, inp: GenerateInput, policy: SpeculationPolicy) -> tuple[str, int | None]:
        """(drafter name, tree cap) within the tenant's policy: a request may turn speculation
        off or shrink its tree, never go past what its tenant allows."""
        if inp.speculation not in (None, True, False):
            raise errors.invalid("speculation must be true, false or null", "speculation")
        cap = inp.max_tree_tokens
        if cap is not None and (not _is_int(cap) or cap < 0):
            raise errors.invalid(f"max_tree_tokens must be an integer >= 0, got {cap!r}",
                                 "speculation.max_tree_tokens")
        drafter = next((d for d in policy.drafters if d in self.drafters), None)
        if not policy.enabled or inp.speculation is False or drafter is None:
            return "none", 0
        tenant_cap = policy.max_tree_tokens
        cap = tenant_cap if cap is None else min(cap, tenant_cap)
        return ("none", 0) if cap == 0 else (drafter, cap)

    # ---- limits and admission ----------------------------------------------------------------------
    def _precheck(self, inp: GenerateInput, tenant: Tenant) -> None:
        """429 now if the tenant's limits would refuse even the least this request can cost (a
        one-token prompt, and its max_tokens as far as the context allows). Charges nothing."""
        if self.limiter is None:
            return
        from gateway.tenancy.limits import LimitExceeded
        context = self.step_loop.worker.context_limit
        mt = inp.max_tokens
        least = context if mt is None else min(1 + mt, context) if _is_int(mt) and mt >= 1 else 1
        try:
            self.limiter.precheck(tenant, least)
        except LimitExceeded as exc:
            raise self._refused(tenant.name, exc) from None

    def _acquire(self, prep: _Prepared) -> Grant | None:
        if self.limiter is None:
            return None
        from gateway.tenancy.limits import LimitExceeded
        s = prep.request.stats
        try:
            return self.limiter.acquire(prep.tenant, s.prompt_len + s.max_tokens)
        except LimitExceeded as exc:
            raise self._refused(s.tenant, exc) from None

    def _refused(self, tenant: str, exc: Exception) -> ApiError:
        """A limiter's refusal (LimitExceeded) as the client's 429, counted; one that can never
        pass (more tokens than the tenant's whole TPM) as a 400 naming the limit: retrying it
        after Retry-After would only be refused again."""
        if not exc.retryable:
            self.metrics.rejected(tenant)
            return errors.invalid(exc.message, "max_tokens", code=f"request_exceeds_{exc.kind}")
        self.metrics.refused(tenant, str(exc.kind), "rate_limited")
        return errors.rate_limited(exc.message, exc.retry_after_s,
                                   code=f"{exc.kind}_exceeded" if exc.kind else "rate_limit_exceeded")

    def _submit(self, prep: _Prepared, grant: Grant | None, aio: asyncio.AbstractEventLoop,
                t0: float) -> "RequestStream":
        stream = RequestStream(self, prep, grant, aio, t0)
        self._sync_tenant(prep.tenant)
        req = prep.request
        if grant is not None:
            req.meta["grant"] = grant.to_list()    # a restarted gateway corrects its charge
        # NOTE: what the loop's submit refuses with ValueError (empty prompt, no room in the
        # context) was refused above; a ValueError here is a server fault, not the client's.
        verdict = self.step_loop.submit(req, stream.sink)
        if verdict is not ADMITTED:
            tenant = req.stats.tenant
            if verdict.http_status == 429:
                self.metrics.refused(tenant, verdict.reason, "queue_full")
                raise errors.rate_limited("too many requests of this API key are waiting; "
                                          "retry later", verdict.retry_after_s,
                                          code="tenant_queue_full")
            self.metrics.refused(tenant, verdict.reason, "overloaded")
            raise errors.overloaded(retry_after_s=verdict.retry_after_s, code="queue_full")
        self.metrics.admitted(req.stats.tenant, req.stats.prompt_len)
        stream.admitted = True
        return stream

    async def forget_tenant(self, tenant_id: str, name: str) -> None:
        """A tenant was removed (the admin API's DELETE): the engine frees its caches, keyed by
        `tenant_id` (at the step loop's next boundary), and /metrics drops the series labelled
        `name`. Requests of it still running finish; what they add to the metrics afterwards
        shows again until the next removal of that name."""
        self._tenants_seen.pop(tenant_id, None)
        self.step_loop.drop_tenant(tenant_id)
        self.metrics.forget_tenant(name)

    def sweep_tenants(self, list_tenants: Callable[[], Iterable[Tenant]]) -> list[str]:
        """Forget (`forget_tenant`) every tenant this service has served that `list_tenants()`
        (the store's tenants now) no longer holds: one removed through another gateway replica,
        which alone heard the DELETE. A name that is live again (the tenant created anew) keeps
        its series. Any thread. Returns the ids forgotten.

        NOTE: the tenants served are read *before* the store: a tenant created and served
        between the two reads would otherwise look removed, and its id be dropped for good."""
        seen = list(self._tenants_seen.items())
        live = list(list_tenants())
        ids, names = {t.id for t in live}, {t.name for t in live}
        gone = [(i, n) for i, n in seen if i not in ids]
        for tenant_id, name in gone:
            self._tenants_seen.pop(tenant_id, None)
            self.step_loop.drop_tenant(tenant_id)
            if name not in names:
                self.metrics.forget_tenant(name)
            log.info("tenant %r was removed elsewhere: its caches and series dropped here", name)
        return [i for i, _ in gone]

    def _sync_tenant(self, tenant: Tenant) -> None:
        """Bring the scheduler's view of a tenant up to date (tenants change at run time)."""
        self._tenants_seen[tenant.id] = tenant.name
        self.step_loop.set_tenant(tenant.name, weight=float(tenant.weight), max_queued=tenant.max_queued)


class RequestStream:
    """One admitted request's events as an async iterator: `StreamChunk`s, then one
    `GenerateOutput`. `aclose()` (or dropping it) before the end cancels the request, unless it
    is detached: then the service adopts it (`GenerationService.adopt`) and it runs to its end."""

    def __init__(self, service: GenerationService, prep: _Prepared, grant: Grant | None,
                 aio: asyncio.AbstractEventLoop, t0: float) -> None:
        self.service = service
        self.prep = prep
        self.request_id = prep.request.request_id
        self.grant = grant
        self.admitted = False
        self._aio = aio
        self._queue: asyncio.Queue = asyncio.Queue()
        self._t0 = t0
        self._last_t: float | None = None
        req = prep.request
        self._text = OutputText(service.tokenizer, req.prompt_ids, prep.stops)
        self._ids: list[int] = []
        self._pending_ids: list[int] = []
        self._out: collections.deque = collections.deque()
        # logprobs, when asked for: each token's entry, with the offset of its text, found by a
        # detokenizer of their own fed one token at a time
        self._logprobs = _LogprobTrack(service.tokenizer, req.prompt_ids) \
            if req.sampling.logprobs is not None else None
        self._ended = False          # the Finished event was handled (or the stream was closed)
        self._closed = False
        self._detached = bool(req.meta.get("detached"))
        self._adopted = False        # detached, and handed to the service when closed early

    # ---- the loop's thread ----------------------------------------------------------------------
    def sink(self, event: Delta | Finished) -> None:
        if isinstance(event, Finished):
            drafter = self.prep.request.drafter or "default"
            self.service.metrics.request_stats(event.stats, drafter)
        if self._closed:
            return
        try:
            self._aio.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:                           # the event loop is gone: nobody listens
            self._closed = True

    # ---- the consumer's event loop ------------------------------------------------------------------
    def __aiter__(self) -> AsyncIterator[StreamChunk | GenerateOutput]:
        return self

    async def __anext__(self) -> StreamChunk | GenerateOutput:
        while not self._out:
            if self._ended:
                raise StopAsyncIteration
            event = await self._queue.get()
            if isinstance(event, Delta):
                self._on_delta(event)
            else:
                settled = self._on_finished(event)
                if settled is not None and not settled.done():      # done: released inline
                    # the slot is free before the client hears the end: its next request fits
                    await asyncio.shield(asyncio.wrap_future(settled))
        return self._out.popleft()

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        """Stop listening; cancel the request if it has not ended (idempotent). Never waits: the
        grant's release runs on the grant keeper's thread."""
        if self._closed:
            return
        if self._detached and self.admitted and not self._ended and not self._adopted:
            self._adopted = True     # nobody listens any more; it runs on (a second close cancels)
            try:
                self.service.adopt(self)
                return
            except RuntimeError:     # no running event loop (collected late): cancel it below
                pass
        self._closed = True
        if self.admitted and not self._ended:
            self._ended = True
            self.service.step_loop.cancel(self.request_id)
            self._settle("cancelled")

    def __del__(self) -> None:                         # never iterated nor closed: do not leak it
        try:
            self.close()
        except Exception:
            pass

    def _on_delta(self, event: Delta) -> None:
        if self._text.stopped:
            return                                     # committed past a stop string: not shown
        now = time.perf_counter()
        tenant = self.prep.request.stats.tenant
        if self._last_t is None:
            self.service.metrics.first_token(tenant, now - self._t0)
        else:
            self.service.metrics.tokens(tenant, now - self._last_t, len(event.token_ids))
        self._last_t = now
        # token by token (gateway/text.py `OutputText`): the tokens after a stop string are cut
        text, taken = self._text.push(event.token_ids)
        ids = event.token_ids[:taken]
        self._ids.extend(ids)
        self._pending_ids.extend(ids)
        if self._logprobs is not None and event.logprobs is not None:
            self._logprobs.add(ids, event.logprobs[:taken])
        if self._text.stopped:
            self.service.step_loop.cancel(self.request_id, status=Status.FINISHED,
                                          cause="stop_string")
        self._emit(text)

    def _on_finished(self, event: Finished) -> concurrent.futures.Future | None:
        stopped = self._text.stopped
        self._emit(self._text.finish(), final=not stopped)
        s = event.stats
        reason = "stop" if stopped else (event.finish_reason or "error")
        if event.status is Status.FAILED:
            log.warning("request %s failed: %s", self.request_id, event.error)
            reason = "error"
        spec = SpecStats.of(s)
        self._ended = True
        settled = self._settle({"stop": "finished", "length": "finished", "abort": "cancelled"}
                               .get(reason, "failed"))
        self._out.append(GenerateOutput(
            self.request_id, self._text.text, tuple(self._ids), reason,
            self.prep.request.stats.prompt_len, len(self._ids), spec,
            self._logprobs.sent if self._logprobs is not None else None))
        return settled

    def _emit(self, text: str, *, final: bool = False) -> None:
        """A chunk of new text, with the logprobs of the tokens whose text now shows (`final`:
        the generation ended without a stop string, so every token's go out, those without
        text, such as a stop token, included)."""
        lps = None
        if self._logprobs is not None:
            lps = self._logprobs.take(None if final else len(self._text.text))
        if text or lps:
            self._out.append(StreamChunk(text, tuple(self._pending_ids), lps))
            self._pending_ids.clear()

    def _settle(self, status: str) -> concurrent.futures.Future | None:
        """Count the request's end and release its grant (on the keeper's thread when the
        limiter is remote); the release's future, or None without a grant."""
        s = self.prep.request.stats
        settled = None
        if self.service.grants is not None and self.grant is not None:
            try:
                settled = self.service.grants.release(self.grant, s.prompt_len + len(self._ids))
            except Exception:                          # a memory limiter's bug: log, go on
                log.exception("limiter release failed for %s", self.request_id)
            self.grant = None
        self.service.metrics.done(s.tenant, status, time.perf_counter() - self._t0, len(self._ids))
        return settled


class _LogprobTrack:
    """A request's logprob entries as its tokens commit, and which have gone out: an entry goes
    out once the text shown reaches past where its token's text starts, so a token cut by a stop
    string never shows (its text is not shown either)."""

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self._pieces: dict[int, tuple[str, tuple[int, ...]]] = {}
        self._held: collections.deque = collections.deque()
        self._sent: list[TokenLogprobs] = []

    def add(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob]) -> None:
        for tok, (lp, top) in zip(token_ids, logprobs):
            offset = len(self._detok.text)
            self._detok.push([tok])
            text, raw = self._piece(tok)
            self._held.append(TokenLogprobs(text, raw, _finite(lp), tuple(
                (*self._piece(t), _finite(v)) for t, v in top), offset))

    def take(self, shown: int | None) -> tuple[TokenLogprobs, ...]:
        """The held entries whose text starts before character `shown` (None: all of them)."""
        out = []
        while self._held and (shown is None or self._held[0].offset < shown):
            out.append(self._held.popleft())
        self._sent += out
        return tuple(out)

    @property
    def sent(self) -> tuple[TokenLogprobs, ...]:
        return tuple(self._sent)

    def _piece(self, token_id: int) -> tuple[str, tuple[int, ...]]:
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._pieces[token_id] = token_piece(self.tokenizer, token_id)
        return piece


def _finite(logprob: float) -> float:
    """JSON has no -inf: a token the model rules out entirely shows as -9999 (as vLLM does)."""
    return max(float(logprob), -9999.0)


# ---- field checks (pure) -------------------------------------------------------------------------------
def _prompt_chars(inp: GenerateInput) -> tuple[str, int] | None:
    """(field, characters) of a text prompt or of its messages' contents; None for token ids or
    a malformed input (`_tokenize` names what is wrong)."""
    if inp.prompt_ids is not None:
        return None
    if isinstance(inp.prompt, str):
        return "prompt", len(inp.prompt)
    if isinstance(inp.messages, list):
        return "messages", sum(len(m["content"]) for m in inp.messages
                               if isinstance(m, dict) and isinstance(m.get("content"), str))
    return None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")


def _sampling(inp: GenerateInput, vocab: int) -> SamplingParams:
    t, p, k = inp.temperature, inp.top_p, inp.top_k
    if not _is_number(t) or not 0 <= t <= MAX_TEMPERATURE:
        raise errors.invalid(f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], got {t!r}",
                             "temperature")
    if not _is_number(p) or not 0 < p <= 1:
        raise errors.invalid(f"top_p must be a number in (0, 1], got {p!r}", "top_p")
    if not _is_int(k) or k < 0:
        raise errors.invalid(f"top_k must be an integer >= 0 (0: off), got {k!r}", "top_k")
    seed = inp.seed
    if seed is not None and (not _is_int(seed) or not -(2**63) <= seed < 2**64):
        raise errors.invalid("seed must be a 64-bit integer", "seed")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(inp, name)
        if not _is_number(v) or not -2 <= v <= 2:
            raise errors.invalid(f"{name} must be a number in [-2, 2], got {v!r}", name)
    lp = inp.logprobs
    if lp is not None and (not _is_int(lp) or not 0 <= lp <= MAX_TOP_LOGPROBS):
        raise errors.invalid(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {lp!r}",
                             "top_logprobs")
    return SamplingParams(temperature=float(t), top_k=k, top_p=float(p), seed=seed,
                          presence_penalty=float(inp.presence_penalty),
                          frequency_penalty=float(inp.frequency_penalty),
                          logit_bias=_logit_bias(inp.logit_bias, vocab), logprobs=lp,
                          # a forced tool call's schema, else the response_format's
                          constraint=tool_calls.forced_constraint(inp.tools, inp.tool_choice) or inp.constraint)


def _logit_bias(bias: Any, vocab: int) -> tuple[tuple[int, float], ...]:
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
        if not _is_number(value) or not -100 <= value <= 100:
            raise errors.invalid(f"logit_bias values must be numbers in [-100, 100], got {value!r} "
                                 f"for token {key}", "logit_bias")
        out.append((int(key), float(value)))
    return tuple(sorted(out))


def _stops(stop: Any) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > MAX_STOPS:
        raise errors.invalid(f"at most {MAX_STOPS} stop strings, got {len(stops)}", "stop")
    for s in stops:
        if not isinstance(s, str) or len(s) > MAX_STOP_CHARS:
            raise errors.invalid(f"each stop string must be a string of at most "
                                 f"{MAX_STOP_CHARS} characters", "stop")
    return tuple(s for s in stops if s)
