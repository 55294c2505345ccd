"""Stored responses (gateway/responses/store.py), in memory and in a real Redis: kept for their
TTL, a final written once the request ended (never into an expired or deleted response), ids
unique; and a restarted gateway's take-over of what the old one left (GenerationService.take_over):
background responses kept when they end, client-tied requests cancelled, TPM charges corrected."""
from __future__ import annotations

import asyncio
import time

import pytest
import redis

from gateway.builders.embedded import build_embedded
from gateway.responses.objects import Header
from gateway.responses.redis_store import RedisResponses
from gateway.responses.store import MemoryResponses
from gateway.service import GenerateInput
from gateway.settings import Settings
from gateway.tenancy.limits import Limiter
from gateway.tenancy.records import Tenant
from scheduler.request import Status


def header(rid: str = "resp_1", tenant_id: str = "t-1") -> Header:
    return Header(rid, tenant_id, "m", 1, [{"role": "user", "content": "hi"}], "be brief",
                  background=True, metadata={"k": "v"})


@pytest.fixture(params=["memory", "redis"])
def make_store(request, redis_url, redis_prefix):
    clients = []

    def make(ttl_s: float):
        if request.param == "memory":
            return MemoryResponses(ttl_s)
        client = redis.Redis.from_url(redis_url)
        clients.append(client)
        return RedisResponses(client, redis_prefix, ttl_s)
    yield make
    for c in clients:
        c.close()


def test_a_response_is_kept_once_and_its_final_written_into_it(make_store):
    store = make_store(60)
    assert store.put(header()) and not store.put(header())           # ids are unique
    held = store.get("resp_1")
    assert held.header == header() and held.final is None
    final = {"status": "finished", "output_ids": [5, 6], "input_tokens": 3}
    assert store.finalize("resp_1", final) and store.get("resp_1").final == final
    assert store.get("resp_2") is None
    assert store.delete("resp_1") and not store.delete("resp_1")
    assert store.get("resp_1") is None
    assert not store.finalize("resp_1", final)                        # never recreated
    assert store.get("resp_1") is None


def test_responses_expire_with_or_without_a_final(make_store):
    store = make_store(0.3)
    store.put(header("resp_a"))
    store.put(header("resp_b"))
    store.finalize("resp_b", {"status": "finished"})
    time.sleep(0.5)
    assert store.get("resp_a") is None and store.get("resp_b") is None
    assert not store.finalize("resp_a", {"status": "finished"})
    assert store.get("resp_a") is None


def test_a_restarted_gateway_keeps_background_responses_cancels_the_rest_and_corrects_usage(
        redis_url, redis_prefix):
    settings = Settings(fake_worker=True, redis_url=redis_url, store_prefix=redis_prefix,
                        replica_id="r1", log_level="critical")
    first = build_embedded(settings)
    tenant = Tenant("acme", tpm=10_000)
    first.tenants.put(tenant, ["sk-acme"])
    tenant = first.tenants.authenticate("sk-acme")
    limiter = Limiter(redis_url, redis_prefix)

    def tpm_tat() -> float:
        """The TPM bucket's backlog in seconds (its theoretical arrival time past now)."""
        now = time.time()
        return max(0.0, limiter._buckets.usage(tenant, now).tpm_tat - now)

    async def admit(detached: bool, max_tokens: int) -> str:
        stream = first.service.stream(GenerateInput(tenant, "smollm2-135m", prompt="left behind",
                                                    max_tokens=max_tokens, detached=detached))
        stream.close = lambda: None                    # the crash: nobody cancels or releases it
        return stream.request_id

    assert tpm_tat() == 0.0
    tied = asyncio.run(admit(False, 4000))            # charged prompt + 4,000 tokens
    charged = tpm_tat()
    assert charged > 20.0                              # 4,000 tokens at 10,000 a minute: 24 s
    kept = asyncio.run(admit(True, 30))
    second = build_embedded(settings)
    assert second.recovered == [tied, kept] and second.cancelled == [tied]
    held = second.responses.responses
    held.put(Header(kept, tenant.id, "smollm2-135m", 1, []))     # as if it were a response
    second.start()
    try:
        deadline = time.monotonic() + 10
        while (held.get(kept).final is None or tpm_tat() > 0.5 * charged) \
                and time.monotonic() < deadline:
            time.sleep(0.02)
        rec = second.step_loop.store.get(tied)
        assert rec.stats.status is Status.CANCELLED and rec.output_ids == []
        # the tied request used its prompt only: nearly all of its charge is given back (the
        # backlog also drains with time, but only by the seconds this took)
        assert tpm_tat() < 0.1 * charged
        final = held.get(kept).final                     # kept when it ended, by the new process
        assert final["status"] == "finished" and len(final["output_ids"]) == 30
    finally:
        second.stop()
        first.step_loop.store.close()
