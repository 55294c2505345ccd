"""The generation service: what REST and gRPC both call. No HTTP in here.

One request, in order:
    arrive    called by the front as the request arrives, before its body is read: one unit of
              the tenant's requests per minute, whatever becomes of the request (429 if none is
              left), so that a refused request is not free;
    precheck  the tenant's token and concurrency limits as they stand (429 with Retry-After),
              before any work on its prompt: a tenant over its limits costs no tokenization;
    measure   the model (404 unknown, 403 not allowed), then the request's one measure against
              the caps (`sizes`: 413 for a prompt, tools and tool calls included, that cannot fit
              the context or the tenant's `max_prompt_tokens`, or a schema too large), before
              anything is templated, tokenized or compiled;
    check     the fields (400, naming the field), the constraint (compiled);
    tokenize  prompt or messages (chat template; one it refuses is a 400) → ids; the context and
              the tenant's `max_prompt_tokens` bound the prompt (413);
    limit     the tenant's token and concurrency limits, charged (429 with Retry-After; 400 for a
              request larger than the tenant's whole TPM, which waiting cannot help);
    submit    to the step loop, with the tenant's priority, weight and speculation policy
              (a full queue: 429 for the tenant's own queue, 503 for the scheduler's);
    stream    the loop's events, bridged from its thread into asyncio, through the incremental
              detokenizer and the stop-string matcher; a stop string ends the request early.

Its rooms: `types` (the data in and out), `sizes`, `fields` and `prepare` (measure, check and
tokenize: API input → scheduler request, nothing charged), `admission` (arrive, precheck, limit,
submit), `stream` (the
loop's events as a client's stream), `tenant_sync` (the loop's and the metrics' view of
tenants), and `core`, the `GenerationService` façade over them.

`open_stream()` does precheck … submit in a worker thread, whatever the request's size: measuring
a request's tools, templating and tokenizing its prompt are work proportional to it, and the
limiter's and the state store's calls (`submit` persists the request) may wait on the network, up
to the store's timeout; none may hold up the event loop, which serves every other stream and
/health. `stream()` is the same, on the calling thread.
A concurrency grant is kept by `gateway.tenancy.grants.GrantKeeper`: renewed while the request
runs, released (off the event loop, retried if the store does not answer) however it ends.
Both admit eagerly: they raise `ApiError` before returning, so a caller can still answer
with an error status; the iterator it returns yields `StreamChunk`s then one `GenerateOutput`.
Closing it early (`aclose()`, a client gone) cancels the request and frees its KV within a step,
unless the request is detached (a background response, a resumable chat stream): then it runs to
its end with nobody listening (`adopt`), and readers follow it from the state store.
"""
from gateway.service.core import GenerationService
from gateway.service.fields import MAX_STOP_CHARS, MAX_STOPS
from gateway.service.stream import RequestStream
from gateway.service.types import (EventStream, GenerateInput, GenerateOutput, SpecStats,
                                   StreamChunk, TokenLogprobs, new_request_id)

__all__ = ["GenerationService", "RequestStream", "EventStream", "GenerateInput", "GenerateOutput",
           "SpecStats", "StreamChunk", "TokenLogprobs", "new_request_id",
           "MAX_STOPS", "MAX_STOP_CHARS"]
