"""The Responses service in rooms (gateway/responses/service.py over reader.py and keeper.py): a
response store or state store set on the service is the one both rooms then use, so a store
swapped after construction (as a deployment that moves its stores does) is read and written
alike, never half the old one."""
from __future__ import annotations

import asyncio

import pytest

from gateway.errors import ApiError
from gateway.responses.objects import Header
from gateway.responses.service import ResponseService
from gateway.responses.store import MemoryResponses
from gateway.tenancy.records import Tenant
from scheduler.store import MemoryStore


def header(rid: str, tenant: Tenant) -> Header:
    return Header(rid, tenant.id, "smollm2-135m", 1_700_000_000, [{"role": "user", "content": "hi"}])


def test_a_response_store_set_on_the_service_is_read_and_written_by_both_rooms():
    acme, gone = Tenant("acme"), Tenant("gone")
    old, new = MemoryResponses(3600.0), MemoryResponses(3600.0)
    svc = ResponseService(None, old, MemoryStore(), None, cancel=lambda _: None)
    svc.responses = new
    new.put(header("resp_new", acme))
    new.put(header("resp_gone", gone))
    old.put(header("resp_old", acme))
    # read: the new store's response is found, the old store's is not
    assert asyncio.run(svc.retrieve(acme, "resp_new"))["id"] == "resp_new"
    with pytest.raises(ApiError) as e:
        asyncio.run(svc.retrieve(acme, "resp_old"))
    assert e.value.status == 404
    # written: a removed tenant's responses go from the new store, the old one is untouched
    assert svc.sweep_tenants(lambda: [acme]) == [gone.id]
    assert new.get("resp_gone") is None and new.get("resp_new") is not None
    assert old.get("resp_old") is not None
    # deleted through the keeper, from the store the reader found it in
    asyncio.run(svc.delete(acme, "resp_new"))
    assert new.get("resp_new") is None


def test_a_state_store_set_on_the_service_is_the_one_finalize_and_reads_use():
    acme = Tenant("acme")
    responses = MemoryResponses(3600.0)
    svc = ResponseService(None, responses, MemoryStore(), None, cancel=lambda _: None)
    records = MemoryStore()
    svc.records = records
    assert svc.reader.records is records and svc.keeper.records is records
    responses.put(header("resp_1", acme))
    # no record in the new state store: not admitted yet, nothing to keep
    assert asyncio.run(svc.retrieve(acme, "resp_1"))["status"] in ("queued", "in_progress")
    assert svc.finalize("resp_1") is False
