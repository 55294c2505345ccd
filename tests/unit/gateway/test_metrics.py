"""/metrics after real traffic (fake worker): the specgate_* series exist, are per app, and their
values agree with what the responses said (requests, tokens, τ, steps, refusals, queue depth)."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import GatewayMetrics
from gateway.http.server import background_server
from gateway.builders.embedded import build_embedded
from gateway.service import GenerateInput
from gateway.settings import Settings
from gateway.tenancy.records import Tenant

MODEL = "smollm2-135m"
ADMIN = "sk-admin-metrics"
FAKE_STEP_MS = 2.0          # fake steps take time, so time in steps has something to measure


def scrape(c: httpx.Client) -> dict[tuple[str, tuple], float]:
    r = c.get("/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="module")
def server():
    emb = build_embedded(Settings(fake_worker=True, fake_context=1024, admin_key=ADMIN,
                                  fake_step_ms=FAKE_STEP_MS))
    emb.tenants.put(Tenant("alpha"), ["sk-alpha"])
    emb.tenants.put(Tenant("limited", rpm=1), ["sk-limited"])
    emb.start()
    with background_server(emb.app) as url, httpx.Client(base_url=url, timeout=10) as c:
        yield emb, c
    emb.stop()


def test_series_agree_with_the_responses(server):
    emb, c = server
    alpha = {"Authorization": "Bearer sk-alpha"}
    steps = tokens = drafted = accepted = 0
    for i in range(4):
        r = c.post("/v1/completions", headers=alpha,
                   json={"model": MODEL, "prompt": f"count {i}", "max_tokens": 30 + i})
        body = r.json()
        steps += body["specgate"]["steps"]
        tokens += body["usage"]["completion_tokens"]
        drafted += body["specgate"]["drafted"]
        accepted += body["specgate"]["accepted"]
    r = c.post("/v1/chat/completions", headers=alpha,
               json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                     "max_tokens": 25, "stream": True})
    final = json.loads([e for e in r.text.split("\n\n") if e][-2].split("data: ", 1)[1])   # after its id: line
    steps += final["specgate"]["steps"]
    drafted += final["specgate"]["drafted"]
    accepted += final["specgate"]["accepted"]
    tokens += 25
    # a refusal
    lim = {"Authorization": "Bearer sk-limited"}
    c.post("/v1/completions", headers=lim, json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert c.post("/v1/completions", headers=lim,
                  json={"model": MODEL, "prompt": "x", "max_tokens": 2}).status_code == 429

    m = scrape(c)
    assert value(m, "specgate_requests_total", tenant="alpha", status="finished") == 5
    assert value(m, "specgate_requests_total", tenant="limited", status="rate_limited") == 1
    assert value(m, "specgate_rate_limit_refusals_total", tenant="limited", reason="rpm") == 1
    assert value(m, "specgate_generation_tokens_total", tenant="alpha") == tokens
    for h, tier in (("specgate_time_to_first_token_seconds", {"tier": "default"}),
                    ("specgate_e2e_request_latency_seconds", {}),
                    ("specgate_queue_time_seconds", {}), ("specgate_time_in_steps_seconds", {})):
        assert value(m, h + "_count", tenant="alpha", **tier) == 5
        assert value(m, h + "_sum", tenant="alpha", **tier) >= 0
    # time in steps: at least the fake's sleep per step, and within each request's latency
    assert (value(m, "specgate_e2e_request_latency_seconds_sum", tenant="alpha")
            >= value(m, "specgate_time_in_steps_seconds_sum", tenant="alpha")
            >= FAKE_STEP_MS / 1000 * steps > 0)
    assert (value(m, "specgate_e2e_request_latency_seconds_sum", tenant="alpha")
            >= value(m, "specgate_time_to_first_token_seconds_sum", tenant="alpha", tier="default") > 0)
    # τ per step: one observation per step, and they add up to the tokens committed
    assert value(m, "specgate_tau_count", tenant="alpha", drafter="ngram") == steps
    assert value(m, "specgate_tau_sum", tenant="alpha", drafter="ngram") == tokens
    assert value(m, "specgate_drafted_tokens_total", tenant="alpha", drafter="ngram") == drafted
    assert value(m, "specgate_accepted_tokens_total", tenant="alpha", drafter="ngram") == accepted
    assert 0 < accepted <= drafted
    assert value(m, "specgate_inter_token_latency_seconds_count", tenant="alpha", tier="default") > 0
    assert value(m, "specgate_step_duration_seconds_count") >= steps // 2
    assert value(m, "specgate_batch_size_count") == value(m, "specgate_step_duration_seconds_count")
    assert value(m, "specgate_steps_total") == emb.step_loop.steps > 0
    assert ("specgate_perceptible_requests", ()) in m
    assert ("specgate_preemptions_total", ()) in m
    # every context token but each request's last was prefilled once; the fake worker caches none
    assert (value(m, "specgate_prefill_tokens_total", tenant="alpha")
            == value(m, "specgate_prompt_tokens_total", tenant="alpha") - 5 > 0)
    assert value(m, "specgate_prefix_cache_hit_tokens_total", tenant="alpha") == 0


def test_queue_depth_shows_live_requests_by_level_and_status(server):
    emb, c = server
    fake = emb.step_loop.worker.worker
    fake.step_s = 0.005                                # slow fake steps: the request stays live
    try:
        with c.stream("POST", "/v1/completions", headers={"Authorization": "Bearer sk-alpha"},
                      json={"model": MODEL, "prompt": "long", "max_tokens": 1000,
                            "stream": True}) as s:
            lines = s.iter_lines()
            next(lines)
            m = scrape(c)
            depth = {labels: v for (name, labels), v in m.items() if name == "specgate_queue_depth"}
            assert sum(depth.values()) == 1
            ((labels, _),) = [(k, v) for k, v in depth.items() if v]
            assert dict(labels)["status"] in ("queued", "running", "preempted")
            # idle statuses are still there, at zero (dashboards get 0, not "no data")
            assert {dict(k)["status"] for k in depth} == {"queued", "running", "preempted"}
    finally:
        fake.step_s = FAKE_STEP_MS / 1000


def test_each_app_has_its_own_registry():
    a, b = GatewayMetrics(), GatewayMetrics()
    a.refused("t", "rpm", "rate_limited")
    assert a.registry.get_sample_value("specgate_rate_limit_refusals_total",
                                       {"tenant": "t", "reason": "rpm"}) == 1
    assert b.registry.get_sample_value("specgate_rate_limit_refusals_total",
                                       {"tenant": "t", "reason": "rpm"}) is None


def test_preemptions_are_counted():
    # las, one request per step: two long requests take turns, so each is preempted often. Steps
    # take 1 ms, so the first cannot finish before the second is submitted, however busy the CPU.
    emb = build_embedded(Settings(fake_worker=True, fake_step_ms=1.0, policy="las", max_batch=1,
                                  max_resident=2))
    emb.start()
    try:
        async def two():
            t = Tenant("t")
            return await asyncio.gather(*(emb.service.generate(
                GenerateInput(t, MODEL, prompt=p, max_tokens=300)) for p in ("one", "two")))

        outs = asyncio.run(two())
        assert all(o.completion_tokens == 300 for o in outs)
        preempted = emb.metrics.registry.get_sample_value("specgate_preemptions_total")
        assert preempted >= 2
    finally:
        emb.stop()
