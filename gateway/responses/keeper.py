"""Keeping responses: a new one within its tenant's quota, an ended one's output, and dropping
those nobody may read any more (deleted, or their tenant removed).

A response is stored before any work is done for it, so a tenant past its quota is refused (429
or 403) without costing a step. Its output is kept when its request ends, text included, so that
reading it back decodes nothing.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

from gateway.errors import ApiError
from gateway.responses.events import text_of
from gateway.responses.objects import Header
from gateway.responses.quota import Quota, quota_of, refusal
from gateway.responses.reader import kept, reason_of
from gateway.responses.store import ResponseStore
from gateway.tenancy.records import Tenant
from scheduler.store import StateStore, Tail


def final_of(tail: Tail, tokenizer: Any) -> dict[str, Any]:
    """What the response store keeps of an ended response (`ResponseStore.finalize`): its text
    too, so that reading it back decodes nothing."""
    s = tail.stats
    prompt = tail.prompt_ids or []
    return {"status": s.status.value, "reason": reason_of(tail), "output_ids": tail.tokens,
            "text": text_of(tokenizer, prompt, tail.tokens),
            "context": prompt[-8:], "input_tokens": s.prompt_len, "ended_at": s.finished_s}


class ResponseKeeper:
    """The response store's writes; `quota`: what a tenant may keep, where its record does not
    say (None: the store's TTL, no caps)."""

    def __init__(self, responses: ResponseStore, records: StateStore, tokenizer: Any,
                 quota: Quota | None = None) -> None:
        self.responses = responses
        self.records = records
        self.tokenizer = tokenizer
        self.quota = quota

    async def keep(self, tenant: Tenant, header: Header) -> None:
        """Store a new response within its tenant's quota (429 or 403 past it)."""
        quota = quota_of(tenant, self.quota) if self.quota is not None else None
        done = await kept(self.responses.put, header, quota)
        if done:
            return
        if done.over is not None and quota is not None:
            raise refusal(done, quota)
        raise ApiError(500, "response id collision; retry the request", code="server_error")

    async def drop(self, response_id: str) -> None:
        await kept(self.responses.delete, response_id)

    def finalize(self, response_id: str) -> bool:
        """Keep an ended response's output in the response store (any thread; blocking). Called
        when its request ends (`GenerationService.detached_ended`, a client-tied stream's end)."""
        tail = self.records.tail(response_id, 0, prompt=True)
        if tail is None or not tail.stats.status.terminal:
            return False
        return self.responses.finalize(response_id, final_of(tail, self.tokenizer))

    async def forget_tenant(self, tenant_id: str) -> int:
        """A tenant was removed (the admin API's DELETE): its stored responses go too (none of
        them could be read again: ids of tenants are never reused). Returns how many."""
        return await kept(self.responses.drop_tenant, tenant_id)

    def sweep_tenants(self, list_tenants: Callable[[], Iterable[Tenant]]) -> list[str]:
        """Drop the stored responses of every tenant that `list_tenants()` (the tenants now) no
        longer holds: one whose removal's own drop failed (the store away), or a response put
        by a request of it that was already under way. Any thread (blocking). Returns the ids.

        NOTE: the store's tenants are read *before* the tenants: a tenant created between the
        two reads is then in the second, never taken for removed."""
        held = self.responses.tenants()
        live = {t.id for t in list_tenants()}
        gone = sorted(held - live)
        for tenant_id in gone:
            self.responses.drop_tenant(tenant_id)
        return gone
