"""Removing a tenant through the admin API of the real app: the engine is told each request's
tenant by its immutable id (never its name), the removal drops what the engine keeps under that
id and the tenant's series in /metrics, and a tenant created again under the name arrives with a
new id. The fake worker records what it is told; what the real worker then frees is
tests/unit/test_tenant_caches.py, and the same through the tiny model's app is the last test."""
from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from gateway.builders.embedded import build_embedded
from gateway.http.server import background_server
from gateway.metrics import GatewayMetrics
from gateway.settings import Settings

MODEL = "smollm2-135m"
ADMIN = "sk-admin-removal"
PROFILE = Path(__file__).resolve().parents[3] / "scheduler" / "profiles" / "default.json"


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _create(c: httpx.Client, name: str, **fields) -> str:
    r = c.post("/admin/tenants", headers=_auth(ADMIN), json={"name": name, **fields})
    assert r.status_code == 201, r.text
    return r.json()["api_key"]


def _complete(c: httpx.Client, key: str, prompt: str, model: str = MODEL) -> dict:
    r = c.post("/v1/completions", headers=_auth(key),
               json={"model": model, "prompt": prompt, "max_tokens": 6})
    assert r.status_code == 200, r.text
    return r.json()


def _wait_for(check, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "the step loop did not apply the removal"
        time.sleep(0.01)


@pytest.fixture
def served():
    emb = build_embedded(Settings(fake_worker=True, admin_key=ADMIN, fake_context=1024))
    emb.start()
    with background_server(emb.app) as url, httpx.Client(base_url=url, timeout=10) as c:
        yield emb, c
    emb.stop()


def test_the_engine_gets_ids_and_a_removal_drops_the_tenants_caches_and_series(served):
    emb, c = served
    acme, other = _create(c, "acme"), _create(c, "other")
    old_id, other_id = emb.tenants.get("acme").id, emb.tenants.get("other").id
    _complete(c, acme, "tell me a story")
    _complete(c, other, "tell me a story")
    worker = emb.step_loop.worker.worker                # the fake worker, under the metrics'
    assert sorted(worker.tenants.values()) == sorted([old_id, other_id])    # never the names
    text = c.get("/metrics", headers=_auth(ADMIN)).text
    assert 'tenant="acme"' in text and 'tenant="other"' in text

    r = c.delete("/admin/tenants/acme", headers=_auth(ADMIN))
    assert r.status_code == 200 and r.json()["deleted"] is True
    _wait_for(lambda: worker.dropped_tenants == [old_id])
    text = c.get("/metrics", headers=_auth(ADMIN)).text
    assert 'tenant="acme"' not in text and 'tenant="other"' in text

    again = _create(c, "acme")                           # the same name, another tenant
    new_id = emb.tenants.get("acme").id
    assert new_id != old_id
    body = _complete(c, again, "tell me a story")
    assert worker.tenants[body["id"]] == new_id
    assert emb.step_loop.policy.fairness.weights.get("acme") == 1.0   # fairness: by name


def test_every_series_with_a_tenant_label_is_cleared_on_removal():
    m = GatewayMetrics()
    labelled = [v for v in vars(m).values() if "tenant" in getattr(v, "_labelnames", ())]
    assert sorted(x._name for x in m.by_tenant) == sorted(x._name for x in labelled)
    for metric in labelled:
        extra = [n for n in metric._labelnames if n != "tenant"]
        for tenant in ("gone", "kept"):
            child = metric.labels(tenant=tenant, **{n: "x" for n in extra})
            (child.inc if hasattr(child, "inc") else child.observe)(1)
    m.forget_tenant("gone")
    text = m.render()[0].decode()
    assert 'tenant="gone"' not in text
    assert text.count('tenant="kept"') >= len(labelled)


def test_through_the_tiny_models_app_a_recreated_tenant_hits_nothing_of_the_old_ones(tiny_model):
    """The real worker (tiny random Llama, prefix cache, suffix drafter) behind the real app: the
    old tenant's second request hits its cached prefix; after the removal its blocks and suffix
    cache are freed, another tenant's blocks stay, and the tenant created again under the name
    gets no hit for the very same prompt."""
    from gateway.text import ToyTokenizer
    from tests.conftest import tiny_llama
    from workers.model.llama_forward import LlamaForward
    from workers.runtime import Runtime

    model = tiny_llama(vocab=1000)
    rt = Runtime(ToyTokenizer(), LlamaForward(model), None, frozenset({2}))
    emb = build_embedded(Settings(admin_key=ADMIN, drafters="suffix", length_predictor=False,
                                  step_profile=PROFILE, kv_cache_mb=64, prefix_cache_mb=8,
                                  prefill_chunk_tokens=0, model="tiny"), runtime=rt)
    emb.start()
    try:
        with background_server(emb.app) as url, httpx.Client(base_url=url, timeout=30) as c:
            suffix_only = {"speculation": {"drafters": ["suffix"]}}
            acme, other = _create(c, "acme", **suffix_only), _create(c, "other", **suffix_only)
            old_id, other_id = emb.tenants.get("acme").id, emb.tenants.get("other").id
            prompt = "You are a careful assistant. Answer in one line. " * 3    # 4 whole blocks
            _complete(c, acme, prompt, "tiny")
            _complete(c, other, prompt[::-1], "tiny")
            first = _hits(c, "acme")
            _complete(c, acme, prompt, "tiny")
            assert _hits(c, "acme") - first >= 64            # its own prefix hits
            worker = emb.step_loop.worker.worker             # the BatchWorker
            pc, suffix = worker.verifier.prefix_cache, worker.drafter("suffix")
            assert pc.tenant_len(old_id) > 0 and suffix.cached_tokens(old_id) > 0
            held, others = pc.usage_bytes()[0], pc.tenant_len(other_id)

            assert c.delete("/admin/tenants/acme", headers=_auth(ADMIN)).status_code == 200
            # the loop's thread frees both, the prefix cache first
            _wait_for(lambda: pc.tenant_len(old_id) == 0 and suffix.cached_tokens(old_id) == 0)
            assert pc.usage_bytes()[0] < held
            assert pc.tenant_len(other_id) == others > 0
            assert 'tenant="acme"' not in c.get("/metrics", headers=_auth(ADMIN)).text

            again = _create(c, "acme", **suffix_only)
            _complete(c, again, prompt, "tiny")
            assert _hits(c, "acme") == 0                     # the same prompt: no hit
            assert pc.tenant_len(emb.tenants.get("acme").id) > 0   # its own blocks, from now
    finally:
        emb.stop()


def _hits(c: httpx.Client, tenant: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = c.get("/metrics", headers=_auth(ADMIN)).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "specgate_prefix_cache_hit_tokens_total" and s.labels.get("tenant") == tenant:
                return s.value
    return 0.0


def test_a_tenant_removed_through_another_replica_is_dropped_here_by_the_sweep(
        redis_url, redis_prefix):
    """Two gateway replicas over one Redis: the DELETE reaches replica A only; replica B, which
    served the tenant too, finds it gone from the store on its next sweep and drops its caches
    and series as well. A tenant created again under the name is not swept."""
    common = dict(fake_worker=True, admin_key=ADMIN, redis_url=redis_url,
                  store_prefix=redis_prefix, tenant_sweep_s=0.05)
    a = build_embedded(Settings(**common, replica_id="a"))
    b = build_embedded(Settings(**common, replica_id="b"))
    a.start()
    b.start()
    try:
        with background_server(a.app) as url_a, background_server(b.app) as url_b, \
                httpx.Client(base_url=url_a, timeout=10) as ca, \
                httpx.Client(base_url=url_b, timeout=10) as cb:
            acme, kept = _create(ca, "acme"), _create(ca, "kept")
            old = a.tenants.get("acme").id
            _complete(cb, acme, "served by b")
            _complete(cb, kept, "served by b")
            assert 'tenant="acme"' in cb.get("/metrics", headers=_auth(ADMIN)).text
            assert ca.delete("/admin/tenants/acme", headers=_auth(ADMIN)).status_code == 200
            worker_b = b.step_loop.worker.worker            # the fake worker, under the metrics'

            def metrics_b() -> str:
                return cb.get("/metrics", headers=_auth(ADMIN)).text

            _wait_for(lambda: worker_b.dropped_tenants == [old] and 'tenant="acme"' not in metrics_b())
            assert 'tenant="kept"' in metrics_b()
            again = _create(ca, "acme")
            _complete(cb, again, "served by b")
            assert b.service.sweep_tenants(b.tenants.list) == []
            assert 'tenant="acme"' in cb.get("/metrics", headers=_auth(ADMIN)).text
    finally:
        a.stop()
        b.stop()


def test_a_tenant_created_while_the_sweep_reads_the_store_is_not_taken_for_removed(served):
    """The sweep reads what it served before the store: a tenant created and served in between
    is not in the first read, so it is never dropped (a dropped id would be cached for no more)."""
    emb, c = served
    key = _create(c, "early")
    _complete(c, key, "hello")
    late = {}

    def store_now():
        listed = emb.tenants.list()                    # the store as the sweep reads it
        late["key"] = _create(c, "late")               # then created and served, mid-sweep
        _complete(c, late["key"], "hello")
        return listed

    assert emb.service.sweep_tenants(store_now) == []
    late_id = emb.tenants.get("late").id
    assert emb.service.sweep_tenants(emb.tenants.list) == []
    assert late_id not in emb.step_loop.worker.worker.dropped_tenants
