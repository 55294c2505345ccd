"""Service tiers end to end, over the embedded gateway on the fake worker: `service_tier` is
validated, refused when the tenant may not use it, run in the scheduler as that tier, and echoed
in chat and completions bodies, in every SSE chunk, in Responses objects and events, and in gRPC
replies; the tenants file and the admin API set a tenant's tiers and default; /metrics counts
each request against its tier's objectives."""
from __future__ import annotations

import json

import grpc
import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from gateway.grpc_api.proto import specgate_pb2 as pb
from gateway.grpc_api.proto import specgate_pb2_grpc as pb_grpc
from gateway.settings import Settings
from gateway.tenancy.config import TenantsConfigError, parse_tenant
from gateway.tenancy.records import tenant_to_dict
from gateway.tiers import wait_bounds
from test_grpc import serving as grpc_serving
from tests.helpers import serving

MODEL = "smollm2-135m"
GOLD, BASIC, ADMIN = "sk-gold-tiers-000001", "sk-basic-tiers-00001", "sk-admin-tiers-00001"


@pytest.fixture(scope="module")
def gw():
    settings = Settings(fake_worker=True, fake_step_ms=1.0, admin_key=ADMIN, log_level="critical")
    gold = {"service_tiers": ("priority", "default", "flex"), "default_service_tier": "priority"}
    with serving(settings, {"gold": [GOLD], "basic": [BASIC]}, tenant_options={"gold": gold},
                 log_level="critical") as (emb, url):
        yield emb, url


def post(url: str, path: str, key: str, **body) -> httpx.Response:
    return httpx.post(url + path, json={"model": MODEL, "max_tokens": 4, **body},
                      headers={"Authorization": f"Bearer {key}"}, timeout=30)


def sse(resp: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in resp.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("key, asked, ran", [
    (GOLD, "flex", "flex"), (GOLD, "auto", "priority"), (GOLD, None, "priority"),
    (GOLD, "default", "default"), (BASIC, None, "default"), (BASIC, "auto", "default")])
def test_the_tier_a_request_runs_in_is_echoed_by_chat_and_completions(gw, key, asked, ran):
    _, url = gw
    extra = {} if asked is None else {"service_tier": asked}
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", {"prompt": "hi"})):
        r = post(url, path, key, **body, **extra)
        assert r.status_code == 200, r.text
        assert r.json()["service_tier"] == ran
        chunks = sse(post(url, path, key, **body, **extra, stream=True,
                          stream_options={"include_usage": True}))
        assert len(chunks) >= 3 and all(c["service_tier"] == ran for c in chunks)


def test_a_tier_the_tenant_may_not_use_is_refused_and_an_unknown_one_is_invalid(gw):
    emb, url = gw
    before = len(emb.step_loop.state.requests)
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", {"prompt": "hi"})):
        for stream in (False, True):
            r = post(url, path, BASIC, **body, service_tier="priority", stream=stream)
            assert r.status_code == 403, r.text
            err = r.json()["error"]
            assert (err["code"], err["param"], err["type"]) == (
                "service_tier_not_allowed", "service_tier", "permission_error")
            assert "'default'" in err["message"]
        r = post(url, path, GOLD, **body, service_tier="scale")
        assert r.status_code == 400 and r.json()["error"]["param"] == "service_tier"
        r = post(url, path, GOLD, **body, service_tier=3)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_value"
    r = httpx.post(url + "/v1/responses", json={"model": MODEL, "input": "hi", "service_tier": "flex"},
                   headers={"Authorization": f"Bearer {BASIC}"}, timeout=30)
    assert r.status_code == 403 and r.json()["error"]["code"] == "service_tier_not_allowed"
    assert len(emb.step_loop.state.requests) == before          # nothing was admitted


def test_the_scheduler_plans_each_request_in_its_tier(gw):
    """The step loop's record of a finished request holds the tier it was planned in."""
    emb, url = gw
    r = post(url, "/v1/completions", GOLD, prompt="hi", service_tier="flex")
    record = emb.step_loop.store.get(r.json()["id"])
    assert record.stats.tier == "flex" and record.stats.plan_class > 0


def test_responses_objects_and_events_carry_the_tier(gw):
    _, url = gw
    auth = {"Authorization": f"Bearer {GOLD}"}
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 4, "service_tier": "flex"}
    r = httpx.post(url + "/v1/responses", json=body, headers=auth, timeout=30)
    assert r.status_code == 200 and r.json()["service_tier"] == "flex"
    got = httpx.get(url + f"/v1/responses/{r.json()['id']}", headers=auth, timeout=30).json()
    assert got["service_tier"] == "flex"
    events = httpx.post(url + "/v1/responses", json={**body, "stream": True, "service_tier": None},
                        headers=auth, timeout=30)
    objects = [e["response"] for e in sse(events) if "response" in e]
    assert len(objects) >= 3 and all(o["service_tier"] == "priority" for o in objects)


def test_a_resumed_chat_stream_carries_the_tier(gw):
    _, url = gw
    r = post(url, "/v1/chat/completions", GOLD, **CHAT, service_tier="flex", stream=True,
             stream_options={"resumable": True})
    rid = sse(r)[0]["id"]
    again = httpx.get(url + f"/v1/chat/completions/{rid}/stream",
                      headers={"Authorization": f"Bearer {GOLD}"}, timeout=30)
    chunks = sse(again)
    assert len(chunks) >= 2 and all(c["service_tier"] == "flex" for c in chunks)


def test_grpc_takes_the_tier_and_echoes_it(gw):
    emb, _ = gw
    gold = (("authorization", f"Bearer {GOLD}"),)
    with grpc_serving(emb.service, emb.tenants, emb.replayer) as channel:
        stub = pb_grpc.GenerationStub(channel)
        req = pb.GenerateRequest(model=MODEL, prompt="hi", max_tokens=4, service_tier="flex")
        assert stub.Generate(req, metadata=gold, timeout=30).service_tier == "flex"
        plain = pb.GenerateRequest(model=MODEL, prompt="hi", max_tokens=4)
        assert stub.Generate(plain, metadata=gold, timeout=30).service_tier == "priority"
        call = stub.GenerateStream(req, metadata=gold, timeout=30)
        messages = list(call)
        assert messages[-1].final.service_tier == "flex"
        assert dict(call.initial_metadata())["service-tier"] == "flex"
        refused = pb.GenerateRequest(model=MODEL, prompt="hi", service_tier="priority")
        with pytest.raises(grpc.RpcError) as exc:
            stub.Generate(refused, metadata=(("authorization", f"Bearer {BASIC}"),), timeout=30)
        assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert dict(exc.value.trailing_metadata())["error-code"] == "service_tier_not_allowed"
        bad = pb.GenerateRequest(model=MODEL, prompt="hi", service_tier="gold")
        with pytest.raises(grpc.RpcError) as exc:
            stub.Generate(bad, metadata=gold, timeout=30)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_the_admin_api_sets_a_tenants_tiers_and_default(gw):
    emb, url = gw
    admin = TestClient(emb.app, headers={"Authorization": f"Bearer {ADMIN}"})
    r = admin.post("/admin/tenants", json={"name": "silver", "service_tiers": ["default", "flex"],
                                           "default_service_tier": "flex"})
    assert r.status_code == 201, r.text
    key = r.json()["api_key"]
    listed = {t["name"]: t for t in admin.get("/admin/tenants").json()["data"]}
    assert (listed["silver"]["service_tiers"], listed["silver"]["default_service_tier"]) == (
        ["default", "flex"], "flex")
    assert "service_tiers" not in listed["basic"]          # at their defaults: as before tiers
    assert post(url, "/v1/completions", key, prompt="hi").json()["service_tier"] == "flex"
    assert post(url, "/v1/completions", key, prompt="hi", service_tier="priority").status_code == 403
    bad = admin.post("/admin/tenants", json={"name": "x", "service_tiers": ["flex"],
                                             "default_service_tier": "default"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "default_service_tier"
    bad = admin.post("/admin/tenants", json={"name": "x", "service_tiers": ["gold"]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "service_tiers[0]"


def test_the_tenants_file_sets_tiers_with_defaults_that_keep_every_request_default():
    plain, _ = parse_tenant({"name": "a"})
    assert (plain.service_tiers, plain.default_service_tier) == (("default",), "default")
    assert plain.tier_for(None) == plain.tier_for("auto") == "default"
    assert not plain.allows_tier("priority") and not plain.allows_tier("flex")
    flexy, _ = parse_tenant({"name": "b", "service_tiers": ["flex", "priority"]})
    assert flexy.default_service_tier == "flex"           # no `default` listed: the first
    assert tenant_to_dict(flexy)["service_tiers"] == ["flex", "priority"]
    assert parse_tenant(tenant_to_dict(flexy))[0] == flexy
    # a tenant without tiers is stored, and fingerprinted, exactly as before tiers: an upgrade
    # re-applies no tenants-file entry and the previous release still reads the record
    assert set(tenant_to_dict(plain)) == {"name", "weight", "priority", "rpm", "tpm", "max_concurrent",
                                          "max_queued", "max_prompt_tokens", "models", "speculation"}
    for body, field in (({"service_tiers": []}, "service_tiers"),
                        ({"service_tiers": ["default"], "default_service_tier": "auto"},
                         "default_service_tier"),
                        ({"service_tiers": "default"}, "service_tiers")):
        with pytest.raises(TenantsConfigError) as exc:
            parse_tenant({"name": "c", **body})
        assert exc.value.field == field


def scrape(emb) -> dict:
    body, _ = emb.metrics.render()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(body.decode()) for s in f.samples}


def test_metrics_count_attainment_per_tier_and_tenant(gw):
    emb, url = gw
    before = scrape(emb)
    for _ in range(3):
        assert post(url, "/v1/completions", GOLD, prompt="hi", service_tier="flex").status_code == 200
    after = scrape(emb)

    def count(tenant, tier, objective, result, samples):
        key = ("specgate_slo_requests_total", (("objective", objective), ("result", result),
                                              ("tenant", tenant), ("tier", tier)))
        return samples.get(key, 0.0)

    for objective in ("ttft", "tbt"):
        added = sum(count("gold", "flex", objective, r, after) - count("gold", "flex", objective, r, before)
                    for r in ("met", "missed"))
        assert added == 3
    assert after[("specgate_time_to_first_token_seconds_count", (("tenant", "gold"), ("tier", "flex")))] >= 3
    assert after[("specgate_slo_objective", (("objective", "ttft"), ("tier", "flex")))] == 0.95
    assert after[("specgate_slo_target_seconds", (("objective", "tbt"), ("tier", "priority")))] == 0.1


def test_the_policy_holds_each_tier_to_its_configured_wait(gw):
    emb, _ = gw
    assert emb.step_loop.policy.config.tier_wait_s == {"flex": 300.0}
    tiers = Settings(service_tiers={"default": {"on_miss": "count"},
                                    "priority": {"max_queue_wait_s": 2}}).service_tiers
    assert wait_bounds(tiers) == {"default": None, "priority": 2.0, "flex": 300.0}
    assert tiers["default"].ttft_s == 2.5                  # a tier's fields over its defaults


def test_each_request_counts_once_per_objective_met_or_missed():
    from gateway.metrics import GatewayMetrics
    from gateway.tiers import TierObjectives

    m = GatewayMetrics(tiers={"flex": TierObjectives(ttft_s=1.0, tbt_s=0.1, percentile=95)})
    fast = m.times("acme", "flex")
    fast.first_token(0.5)
    fast.tokens(0.05 * 20, 20)                  # 20 gaps of 50 ms: within 100 ms
    fast.ended(2.0)
    slow = m.times("acme", "flex")
    slow.first_token(2.0)                       # past 1 s
    slow.tokens(0.05 * 18, 18)
    slow.tokens(1.0, 2)                         # 2 of 20 gaps over: 10 % > 5 %
    slow.ended(5.0)
    m.times("acme", "flex").ended(5.0)          # no token in 5 s: a TTFT miss, no TBT
    m.times("acme", "flex").ended(0.2)          # cancelled sooner than the target: nothing
    m.times("acme", "gold").ended(9.0)          # a tier with no objectives: nothing

    def value(objective, result):
        return m.registry.get_sample_value("specgate_slo_requests_total", {
            "tenant": "acme", "tier": "flex", "objective": objective, "result": result})

    assert (value("ttft", "met"), value("ttft", "missed")) == (1, 2)
    assert (value("tbt", "met"), value("tbt", "missed")) == (1, 1)
    assert m.registry.get_sample_value("specgate_inter_token_latency_seconds_count",
                                       {"tenant": "acme", "tier": "flex"}) == 40
    m.forget_tenant("acme")
    assert value("ttft", "met") is None


def test_tier_doctests():
    import doctest

    import gateway.tiers
    import scheduler.tiers

    assert doctest.testmod(gateway.tiers).failed == doctest.testmod(scheduler.tiers).failed == 0


def test_a_long_prompts_ttft_objective_exceeds_a_short_ones_by_its_prefill_allowance():
    from gateway.metrics import GatewayMetrics
    from scheduler.step_cost import LinearStepCost

    cost = LinearStepCost(fixed_s=0.01, per_token_s=0.001)
    # the settings' override path takes the new field over the tier's defaults
    o = Settings(service_tiers={"priority": {"ttft_prefill_allowance": 3}}).service_tiers["priority"]
    assert (o.ttft_s, o.ttft_prefill_allowance) == (1.0, 3.0)
    short, long = o.ttft_for(100, cost), o.ttft_for(1000, cost)
    assert long - short == pytest.approx(3.0 * (cost.prefill(1000) - cost.prefill(100)))
    assert o.ttft_for(1000, None) == o.ttft_s                # no profile: the fixed part
    # /metrics judges by it: the same first token is met for the long prompt only
    m = GatewayMetrics(tiers={"priority": o})
    for prompt in (100, 1000):
        t = m.times("acme", "priority", prompt_tokens=prompt, step_cost=cost)
        t.first_token((short + long) / 2)
        t.ended(5.0)
    met = {r: m.registry.get_sample_value("specgate_slo_requests_total", {
        "tenant": "acme", "tier": "priority", "objective": "ttft", "result": r})
        for r in ("met", "missed")}
    assert met == {"met": 1, "missed": 1}
