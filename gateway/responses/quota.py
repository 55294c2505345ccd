"""What a tenant may keep in the response store, and what a client hears past it. Pure.

A stored response costs the store its input (the `Header`: the conversation, instructions,
metadata) and, once it has ended, its output (the final: text and token ids). A tenant may keep at
most `max_count` of them and `max_bytes` of both together, each for `ttl_s` from its creation:
from the gateway's settings, unless the tenant's record says otherwise. A new response is measured
against them when it is created, before any work: its input is known then, its output is not, so
outputs count once written, and a tenant whose responses are running can pass `max_bytes` by
their outputs (which its `max_concurrent` and `max_tokens` bound).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gateway.errors import ApiError
from gateway.responses.objects import Header
from gateway.tenancy.records import Tenant

OVER_COUNT, OVER_BYTES = "count", "bytes"


@dataclass(frozen=True)
class Quota:
    """How long a tenant's stored responses are kept, and how many and how many bytes it may
    keep at once (None: no cap)."""
    ttl_s: float
    max_count: int | None = None
    max_bytes: int | None = None


@dataclass(frozen=True)
class Kept:
    """A store's answer to a put: kept, or not (`over` None: the id is taken; else the quota it
    would pass, "count" or "bytes"). `size`: the bytes it would count; `retry_after_s`: when the
    tenant's first stored response expires (None: none is stored, so waiting frees nothing)."""
    ok: bool
    over: str | None = None
    size: int = 0
    retry_after_s: float | None = None

    def __bool__(self) -> bool:
        return self.ok


KEPT, TAKEN = Kept(True), Kept(False)


def quota_of(tenant: Tenant, defaults: Quota) -> Quota:
    """The tenant's quota: its record's fields where set, the gateway's elsewhere.

    >>> quota_of(Tenant("acme", max_stored_responses=5), Quota(60.0, 100, 1000))
    Quota(ttl_s=60.0, max_count=5, max_bytes=1000)
    """
    return Quota(
        ttl_s=defaults.ttl_s if tenant.responses_ttl_s is None else float(tenant.responses_ttl_s),
        max_count=(defaults.max_count if tenant.max_stored_responses is None
                   else tenant.max_stored_responses),
        max_bytes=(defaults.max_bytes if tenant.max_stored_response_bytes is None
                   else tenant.max_stored_response_bytes))


def over(quota: Quota, count: int, used: int, size: int) -> str | None:
    """Would one more response of `size` bytes pass the quota of a tenant that keeps `count`
    responses of `used` bytes? The quota it would pass, or None. (The Redis store's put script
    applies the same rule: gateway/responses/redis_store.py.)

    >>> over(Quota(1.0, 2, 100), 2, 10, 5), over(Quota(1.0, 2, 100), 1, 90, 20)
    ('count', 'bytes')
    """
    if quota.max_count is not None and count >= quota.max_count:
        return OVER_COUNT
    if quota.max_bytes is not None and used + size > quota.max_bytes:
        return OVER_BYTES
    return None


def header_json(header: Header) -> str:
    """A header as the stores keep it, and as it is counted (ASCII: a character is a byte)."""
    return dumps(header.to_dict())


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def refusal(kept: Kept, quota: Quota) -> ApiError:
    """What the client hears when a new response would pass its tenant's quota: 429 with
    Retry-After when its stored responses expiring (or being deleted) would make room, 403 when
    nothing would (a quota of none, or one response larger than the whole quota)."""
    hint = ("delete stored responses (DELETE /v1/responses/{id}), wait for them to expire, or "
            "send store: false")
    if quota.max_count == 0 or quota.max_bytes == 0:
        return _never("this tenant may not store responses: send store: false")
    if kept.over == OVER_COUNT:
        message = f"this tenant keeps {quota.max_count} stored responses, its most: {hint}"
    elif quota.max_bytes is not None and kept.size > quota.max_bytes:
        return _never(f"this response's input ({kept.size} bytes) is larger than the tenant's "
                      f"quota of stored responses ({quota.max_bytes} bytes): send store: false")
    else:
        message = (f"this tenant's stored responses would hold more than {quota.max_bytes} "
                   f"bytes, its most: {hint}")
    return ApiError(429, message, param="store", code="stored_responses_exceeded",
                    retry_after_s=kept.retry_after_s if kept.retry_after_s is not None else 1.0)


def _never(message: str) -> ApiError:
    return ApiError(403, message, param="store", code="stored_responses_exceeded")
