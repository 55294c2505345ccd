"""What a restarted gateway does with the requests its step loop recovered from the state store.

Their clients' connections died with the old process. A detached request (a background response,
a resumable chat stream: `Request.meta["detached"]`) runs on, as nobody needs to be connected for
it: readers follow it from the store, it still ends at its stop strings, and the service's
`detached_ended` listeners hear when it ends (the Responses API keeps its output then). Any other
request has nobody left to receive it, and is cancelled rather than generate for no one. Either
way, when it ends its tenant's TPM charge is corrected to what it used: the old process charged
prompt + max_tokens at admission and died before correcting it; the grant it charged is kept with
the request (`Request.meta["grant"]`) for this.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

from gateway.tenancy.limits import Grant
from gateway.text import OutputText
from scheduler.loop import Delta, Finished
from scheduler.request import Request, Status

# `service` below is the `gateway.service.GenerationService` whose loop recovered the requests (not
# imported: the service calls in here)
GenerationService = Any

log = logging.getLogger(__name__)


def take_over(service: GenerationService, request_ids: Iterable[str]) -> list[str]:
    """Attach to each recovered request (before the loop steps them), cancel those nobody can
    receive. Any thread; one store read per request (its whole record). Returns the ids
    cancelled."""
    loop = service.step_loop
    cancelled = []
    for rid in request_ids:
        req = loop.store.get(rid)
        if req is None or req.stats.status.terminal:
            continue
        detached = bool(req.meta.get("detached"))
        grant = req.meta.get("grant")
        stops = _stop_watch(service, req) if detached else None
        loop.attach(rid, _sink(service, rid, grant, detached, stops))
        if not detached:
            loop.cancel(rid)
            cancelled.append(rid)
    return cancelled


def _stop_watch(service: GenerationService, req: Request) -> OutputText | None:
    """A detached request's output as its stream would show it, for its stop strings (None
    without any): it ends at one as it would have with its stream attached (a resumed stream
    cuts there anyway: gateway/replay.py; this saves generating past it)."""
    if not req.stop:
        return None
    text = OutputText(service.tokenizer, req.prompt_ids, req.stop)
    text.push(req.output_ids)
    if text.stopped:
        service.step_loop.cancel(req.request_id, status=Status.FINISHED, cause="stop_string")
    return text


def _sink(service: GenerationService, request_id: str, grant: list | None, detached: bool,
          stops: OutputText | None) -> Callable:
    """A recovered request's sink: on the loop's thread, so the end's store calls go to the
    service's `orphans` thread."""
    def sink(event: Delta | Finished) -> None:
        if not isinstance(event, Finished):
            if stops is not None and not stops.stopped:
                stops.push(event.token_ids)
                if stops.stopped:
                    service.step_loop.cancel(request_id, status=Status.FINISHED, cause="stop_string")
            return
        s = event.stats
        service.orphans.submit(_ended, service, request_id, grant, s.prompt_len + s.committed, detached)
    return sink


def _ended(service: GenerationService, request_id: str, grant: list | None, used: int,
           detached: bool) -> None:
    if grant is not None and service.limiter is not None:
        tenant = None
        try:
            g = Grant.from_list(grant)
            tenant = g.tenant
            service.limiter.correct(g, used)
        except Exception:
            log.exception("correcting the usage of recovered request %s failed", request_id)
        finally:
            if tenant is not None and service.grants is not None:
                service.grants.refunded(tenant)    # tokens refunded: its tpm verdicts end
    if detached:
        service.tell_detached_ended(request_id)
