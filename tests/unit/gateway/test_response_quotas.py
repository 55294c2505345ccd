"""What a tenant may keep in the response store (gateway/responses/quota.py), in memory and in a
real Redis: a count and bytes per tenant, refused at creation with `stored_responses_exceeded`
(429 while waiting or deleting would make room, 403 when nothing would), room given back by
deletions and expiry; a removed tenant's stored responses go with it (the admin API's DELETE, and
the sweep for those that outlive it); and the memory store's expiry looks only at what is due."""
from __future__ import annotations

import time

import httpx
import pytest
import redis

from gateway.responses.objects import Header
from gateway.responses.quota import Quota, header_json
from gateway.responses.redis_store import RedisResponses
from gateway.responses.store import MemoryResponses
from gateway.settings import Settings
from tests.helpers import serving

MODEL = "smollm2-135m"
ADMIN = "sk-admin-quotas-0001"


def header(rid: str, tenant_id: str = "t-acme", text: str = "hi") -> Header:
    return Header(rid, tenant_id, MODEL, 1, [{"role": "user", "content": text}])


@pytest.fixture(params=["memory", "redis"])
def make_store(request, redis_url, redis_prefix):
    clients = []

    def make(ttl_s: float = 60.0):
        if request.param == "memory":
            return MemoryResponses(ttl_s)
        client = redis.Redis.from_url(redis_url)
        clients.append(client)
        return RedisResponses(client, redis_prefix, ttl_s)
    yield make
    for c in clients:
        c.close()


def test_a_tenant_at_its_count_is_refused_and_a_deletion_makes_room(make_store):
    store, quota = make_store(), Quota(60.0, max_count=2)
    assert store.put(header("resp_a"), quota) and store.put(header("resp_b"), quota)
    refused = store.put(header("resp_c"), quota)
    assert not refused and refused.over == "count"
    assert 50 < refused.retry_after_s <= 60                  # when its first one expires
    assert store.get("resp_c") is None                       # nothing of it kept
    assert store.put(header("resp_x", "t-other"), quota)     # another tenant's count is its own
    assert store.delete("resp_a")
    assert store.put(header("resp_c"), quota)
    assert not store.put(header("resp_d"), quota)


def test_bytes_count_a_responses_input_and_its_output(make_store):
    store = make_store()
    size = len(header_json(header("resp_a")))
    quota = Quota(60.0, max_bytes=3 * size)
    assert store.put(header("resp_a"), quota) and store.put(header("resp_b"), quota)
    assert store.finalize("resp_a", {"status": "finished", "text": "x" * size})
    refused = store.put(header("resp_c"), quota)              # two inputs and an output: full
    assert not refused and refused.over == "bytes" and refused.size > 0
    assert store.finalize("resp_a", {"status": "finished", "text": "x" * size})   # idempotent
    assert not store.put(header("resp_c"), quota)
    assert store.delete("resp_a")                             # its input and output both freed
    assert store.put(header("resp_c"), quota)


def test_expired_responses_give_their_room_back(make_store):
    store, quota = make_store(), Quota(0.3, max_count=1)
    assert store.put(header("resp_a"), quota)
    assert not store.put(header("resp_b"), quota)
    time.sleep(0.5)
    assert store.put(header("resp_b"), quota)
    assert store.get("resp_a") is None and store.get("resp_b") is not None


def test_dropping_a_tenant_forgets_its_responses_and_no_one_elses(make_store):
    store, quota = make_store(), Quota(60.0, max_count=3)
    for i in range(3):
        assert store.put(header(f"resp_a{i}"), quota)
    assert store.put(header("resp_o", "t-other"), quota)
    assert store.tenants() >= {"t-acme", "t-other"}
    assert store.drop_tenant("t-acme") == 3
    assert all(store.get(f"resp_a{i}") is None for i in range(3))
    assert store.get("resp_o") is not None and "t-acme" not in store.tenants()
    assert store.put(header("resp_n"), quota)                 # its count went with it


class Ticks(float):
    """A time whose comparisons are counted: how many stored responses an expiry looked at."""
    compared = 0

    def __add__(self, other):
        return Ticks(float(self) + other)

    def _count(self, other, op):
        Ticks.compared += 1
        return op(float(self), float(other))

    def __lt__(self, o): return self._count(o, float.__lt__)
    def __le__(self, o): return self._count(o, float.__le__)
    def __gt__(self, o): return self._count(o, float.__gt__)
    def __ge__(self, o): return self._count(o, float.__ge__)


def test_the_memory_stores_expiry_looks_only_at_what_is_due():
    now = [0.0]
    store = MemoryResponses(100.0, clock=lambda: Ticks(now[0]))
    for i in range(2000):
        now[0] = i * 0.01                                     # put over 20 s: expire over 20 s
        assert store.put(header(f"resp_{i}", f"t-{i % 7}"))
    Ticks.compared = 0
    store.get("resp_5")
    assert Ticks.compared <= 2, Ticks.compared                # nothing due: one look per TTL
    now[0] = 100.0 + 5.0                                      # the first 500 or so are due
    Ticks.compared = 0
    assert store.get("resp_5") is None and store.get("resp_1999") is not None
    assert 480 <= Ticks.compared <= 520, Ticks.compared
    Ticks.compared = 0
    store.delete("resp_1500")
    assert Ticks.compared <= 2, Ticks.compared


# ---- through the API ---------------------------------------------------------------------------------
@pytest.fixture(params=["memory", "redis"])
def gw(request, redis_url, redis_prefix):
    redis_on = {"redis_url": redis_url, "store_prefix": redis_prefix, "replica_id": "q1"} \
        if request.param == "redis" else {}
    settings = Settings(fake_worker=True, admin_key=ADMIN, log_level="critical",
                        max_stored_responses=3, **redis_on)
    options = {"small": {"max_stored_response_bytes": 1000}, "none": {"max_stored_responses": 0}}
    with serving(settings, {"acme": ["sk-acme-quotas-01"], "small": ["sk-small-quotas-1"],
                            "none": ["sk-none-quotas-01"]},
                 tenant_options=options, log_level="critical") as (emb, url):
        with httpx.Client(base_url=url, timeout=30) as c:
            yield emb, c


def create(c: httpx.Client, key: str, text: str = "hello", **kw) -> httpx.Response:
    return c.post("/v1/responses", headers={"Authorization": f"Bearer {key}"},
                  json={"model": MODEL, "input": text, "max_output_tokens": 4, **kw})


def test_stored_responses_past_a_quota_are_refused_with_its_code(gw):
    emb, c = gw
    ids = [create(c, "sk-acme-quotas-01").json()["id"] for _ in range(3)]
    r = create(c, "sk-acme-quotas-01")                        # the gateway's default: 3
    assert r.status_code == 429, r.text
    err = r.json()["error"]
    assert err["code"] == "stored_responses_exceeded" and err["param"] == "store"
    assert int(r.headers["Retry-After"]) >= 1
    assert create(c, "sk-acme-quotas-01", store=False).status_code == 200    # not stored: served
    d = c.delete(f"/v1/responses/{ids[0]}", headers={"Authorization": "Bearer sk-acme-quotas-01"})
    assert d.status_code == 200
    assert create(c, "sk-acme-quotas-01").status_code == 200
    # bytes: a tenant's own cap (its record), an input larger than all of it is a 403
    r = create(c, "sk-small-quotas-1", text="x" * 1000)
    assert r.status_code == 403 and r.json()["error"]["code"] == "stored_responses_exceeded"
    assert create(c, "sk-small-quotas-1", text="y" * 400).status_code == 200
    r = create(c, "sk-small-quotas-1", text="y" * 400)        # two would pass 1000 bytes
    assert r.status_code == 429 and r.json()["error"]["code"] == "stored_responses_exceeded"
    r = create(c, "sk-none-quotas-01")
    assert r.status_code == 403 and "may not store" in r.json()["error"]["message"]


def test_removing_a_tenant_removes_its_stored_responses(gw):
    emb, c = gw
    admin = {"Authorization": f"Bearer {ADMIN}"}
    made = c.post("/admin/tenants", headers=admin,
                  json={"name": "gone", "max_stored_responses": 10, "responses_ttl_s": 3600})
    assert made.status_code == 201, made.text
    assert made.json()["tenant"]["max_stored_responses"] == 10
    key = made.json()["api_key"]
    tenant_id = emb.tenants.get("gone").id
    ids = [create(c, key).json()["id"] for _ in range(4)]
    kept = create(c, "sk-acme-quotas-01").json()["id"]
    store = emb.responses.responses
    assert all(store.get(i) is not None for i in ids) and tenant_id in store.tenants()
    assert c.delete("/admin/tenants/gone", headers=admin).status_code == 200
    assert all(store.get(i) is None for i in ids) and tenant_id not in store.tenants()
    assert store.get(kept) is not None


def test_the_sweep_drops_stored_responses_of_tenants_removed_elsewhere(gw):
    emb, c = gw
    store = emb.responses.responses
    assert store.put(header("resp_orphan", "t-never-a-tenant"))       # a removal raced by a put
    kept = create(c, "sk-acme-quotas-01").json()["id"]
    assert emb.responses.sweep_tenants(emb.tenants.list) == ["t-never-a-tenant"]
    assert store.get("resp_orphan") is None and store.get(kept) is not None
