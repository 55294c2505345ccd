"""Ray Serve mode on a real local Ray cluster (2 CPUs), a tiny random model speaking the default
model's tokenizer, and real Redis: deployed from deploy/serve/specgate.yaml with 2 verifier
replicas, answering the official `openai` client exactly as the embedded gateway does, with
every request's prefill and verifications on one replica. Ray starts once for the module."""
from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from gateway.builders.ray_app import build_ray_app as build  # noqa: E402
from gateway.ray_serve.config import RayAppConfig  # noqa: E402
from gateway.cli.serve_ray import RAY_GRPC_MAX_MESSAGE, load_config, load_grpc_options  # noqa: E402
from gateway.ray_serve.replica_secrets import redis_password  # noqa: E402
from gateway.http.server import free_port  # noqa: E402
from gateway.settings import Settings  # noqa: E402
from gateway.tenancy.records import Tenant  # noqa: E402
from gateway.tenancy.tenants import TenantRegistry  # noqa: E402
from redis_server import delete_prefix, unique_prefix  # noqa: E402
from tests.helpers import serving, tiny_model_dir  # noqa: E402

pytestmark = pytest.mark.slow
CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "serve" / "specgate.yaml"
KEY = "sk-ray-test-tenant"
ADMIN = "adm-ray-test-admin-key"
PEPPER = "pep-ray-test-" + "5" * 32
PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time", "1, 2, 3, 4,",
           "Repeat: red green blue red green blue red"]



@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("ray") / "tiny")


@pytest.fixture(scope="module")
def ray_app(model_dir, redis_url):
    prefix = unique_prefix()
    # written unpeppered, as an older release's store: the ingress replicas pepper it at start
    TenantRegistry(redis_url, prefix).put(Tenant(name="t1"), [KEY])
    settings = {"model": str(model_dir), "redis_url": redis_url, "store_prefix": prefix,
                "drafters": "ngram", "grpc_port": free_port(),
                # no sweep: the tenant removal test checks the DELETE's own path
                "tenant_sweep_s": 0}
    port = free_port()
    with pytest.MonkeyPatch.context() as env:
        # Secrets reach the replicas through the environment the local cluster inherits from
        # this process, as `specgate serve --ray` passes them; never through the Serve config.
        env.setenv("SPECGATE_ADMIN_KEY", ADMIN)
        env.setenv("SPECGATE_KEY_PEPPER", PEPPER)
        if redis_password(redis_url):
            env.setenv("SPECGATE_REDIS_URL", settings.pop("redis_url"))
        cfg, _ = load_config(CONFIG, settings)
        cfg.ingress.autoscaling_config, cfg.ingress.num_replicas = None, 2   # fixed: 2 ingress replicas
        cfg.draft.autoscaling_config, cfg.draft.num_replicas = None, 1        # and 1 draft replica
        # Serve's gRPC proxy caps a message by this variable, read where it starts, as `serve
        # --ray` sets it: twice the body cap here, so that the ingress's own cap shows below it
        env.setenv(RAY_GRPC_MAX_MESSAGE, str(2 * cfg.gateway_settings().max_body_bytes))
        ray.init(num_cpus=2, include_dashboard=False, logging_level="error", log_to_driver=False)
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port},
                        grpc_options=load_grpc_options(CONFIG, cfg))
            serve.run(build(cfg), name="specgate", route_prefix="/")
            yield f"http://127.0.0.1:{port}", cfg
        finally:
            # Stopping the local cluster stops every replica with it; serve.shutdown() would first
            # drain each one politely (~9 s) for nothing this module checks.
            ray.shutdown()
            delete_prefix(redis_url, prefix)


@pytest.fixture(scope="module")
def embedded_url(model_dir, redis_url):
    prefix = unique_prefix()
    try:
        with serving(Settings(model=str(model_dir), redis_url=redis_url, store_prefix=prefix,
                              drafters="ngram"), {"t1": [KEY]}) as (_, url):
            yield url
    finally:
        delete_prefix(redis_url, prefix)


def client(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def answers(url: str, model: str) -> list[str]:
    c, out = client(url), []
    for p in PROMPTS:
        out.append(c.completions.create(model=model, prompt=p, max_tokens=24, temperature=0).choices[0].text)
    stream = c.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPTS[0]}],
                                       max_tokens=24, temperature=0, stream=True)
    out.append("".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices))
    return out


def test_openai_client_gets_what_embedded_mode_gives(ray_app, embedded_url, model_dir):
    url, _ = ray_app
    got = answers(url, str(model_dir))
    assert got == answers(embedded_url, str(model_dir))
    assert all(got)                                    # real text came back


def test_grpc_through_serves_proxy_answers_as_rest_does(ray_app, model_dir):
    """gRPC in Ray mode: Serve's gRPC proxy calls the ingress deployment's Generate and
    GenerateStream, which authenticate and refuse as embedded mode's gRPC server does."""
    import grpc

    from gateway.grpc_api.proto import specgate_pb2 as pb
    from gateway.grpc_api.proto import specgate_pb2_grpc as pb_grpc

    url, cfg = ray_app
    model = str(model_dir)
    rest = client(url).completions.create(model=model, prompt=PROMPTS[1], max_tokens=24, temperature=0)
    auth = (("authorization", f"Bearer {KEY}"),)
    with grpc.insecure_channel(f"127.0.0.1:{cfg.gateway_settings().grpc_port}") as channel:
        stub = pb_grpc.GenerationStub(channel)
        req = pb.GenerateRequest(model=model, prompt=PROMPTS[1], max_tokens=24, temperature=0)
        one = stub.Generate(req, metadata=auth, timeout=120)
        parts = list(stub.GenerateStream(req, metadata=auth, timeout=120))
        assert one.text == rest.choices[0].text and one.text
        assert one.usage.completion_tokens == rest.usage.completion_tokens
        assert "".join(p.delta.text for p in parts if p.HasField("delta")) == one.text
        assert parts[-1].final.text == one.text and parts[-1].final.finish_reason == "length"
        # a stream (any front) resumed over gRPC at an ingress replica, read from Redis
        rid = rest.id
        resumed = list(stub.Resume(pb.ResumeRequest(request_id=rid, after=0), metadata=auth, timeout=120))
        assert "".join(p.delta.text for p in resumed if p.HasField("delta")) == one.text
        assert resumed[-1].final.text == one.text and resumed[-1].final.finish_reason == "length"
        with pytest.raises(grpc.RpcError) as err:             # read from the store, tenant-scoped
            list(stub.Resume(pb.ResumeRequest(request_id="cmpl-nope", after=0), metadata=auth, timeout=60))
        assert err.value.code() is grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(req, metadata=(("authorization", "Bearer sk-nobody"),), timeout=60)
        assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(pb.GenerateRequest(model=model, prompt="x", temperature=-1), metadata=auth, timeout=60)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "temperature" in err.value.details()
        # a message over the body cap: Serve's proxy refuses it past its own cap (twice the body
        # cap here), and the ingress below it, before any work on it
        cap = cfg.gateway_settings().max_body_bytes
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(pb.GenerateRequest(model=model, prompt="x" * (cap + 1)), metadata=auth, timeout=60)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert f"larger than {cap} bytes" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(pb.GenerateRequest(model=model, prompt="x" * (2 * cap + 1)), metadata=auth,
                          timeout=60)
        assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_chat_stream_resumes_at_any_ingress_replica_from_redis(ray_app, model_dir):
    url, _ = ray_app
    body = {"model": str(model_dir), "messages": [{"role": "user", "content": PROMPTS[2]}],
            "max_tokens": 24, "temperature": 0, "stream": True}
    auth = {"Authorization": f"Bearer {KEY}"}

    def chunks(method: str, path: str, **kw) -> list[tuple[str | None, dict]]:
        out, event_id = [], None
        with httpx.stream(method, url + path, headers={**auth, **kw.pop("headers", {})}, timeout=120,
                          **kw) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("id: "):
                    event_id = line[4:]
                elif line.startswith("data: {"):
                    out.append((event_id, json.loads(line[6:])))
        return out

    def content(evs) -> str:
        return "".join(e["choices"][0]["delta"].get("content") or "" for _, e in evs if e["choices"])

    def ends(evs) -> list:
        return [(i, e) for i, e in evs if not (e["choices"] and e["choices"][0]["delta"].get("content"))]

    live = chunks("POST", "/v1/chat/completions", json=body)
    rid = live[0][1]["id"]
    assert content(live)
    for k in (0, 2, len(live) - 2):
        resumed = chunks("GET", f"/v1/chat/completions/{rid}/stream", headers={"Last-Event-ID": live[k][0]})
        assert content(resumed) == content(live[k + 1:]) and ends(resumed) == ends(live[k + 1:])


def test_draft_workers_propose_and_their_loss_costs_only_speculation(ray_app, embedded_url, model_dir):
    url, _ = ray_app
    draft = serve.get_deployment_handle("draft", app_name="specgate")
    before = draft.proposed.remote().result()
    prompt = "red green blue " * 8                   # repetitive: the n-gram drafter proposes
    expected = answers(embedded_url, str(model_dir))
    assert answers(url, str(model_dir)) == expected
    # A tenant new to the planner: its first request starts with no pooled evidence about the
    # drafter (scheduler/alpha.py DrafterPrior), so the planner probes it and the draft worker
    # is asked, whatever t1's earlier requests taught the planner of this drafter's cost.
    with httpx.Client(base_url=url, timeout=60) as h:
        fresh = h.post("/admin/tenants", headers={"Authorization": f"Bearer {ADMIN}"},
                       json={"name": "drafty"}).json()["api_key"]
    client(url, fresh).completions.create(model=str(model_dir), prompt=prompt, max_tokens=24, temperature=0)
    assert draft.proposed.remote().result() > before        # the trees came from the draft worker
    name = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if "#draft#" in a["name"])
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    c = client(url)
    out = c.completions.create(model=str(model_dir), prompt=prompt, max_tokens=40, temperature=0)
    ref = client(embedded_url).completions.create(model=str(model_dir), prompt=prompt, max_tokens=40,
                                                  temperature=0)
    assert out.choices[0].text == ref.choices[0].text          # correct without (some) drafts
    assert answers(url, str(model_dir)) == expected             # and after Serve replaces it


def test_every_call_of_a_request_reaches_one_replica_and_requests_spread(ray_app, model_dir):
    """Requests spread over the verifier replicas (by KV room), every call of one reaching one
    replica; the planner budgets each replica by what that replica reports of its KV pool."""
    url, _ = ray_app
    c = client(url)
    with ThreadPoolExecutor(6) as pool:                # concurrent: the scheduler batches them
        outs = list(pool.map(lambda p: c.completions.create(
            model=str(model_dir), prompt=p * 3, max_tokens=40, temperature=0), PROMPTS + PROMPTS[:1]))
    assert all(o.usage.completion_tokens == 40 for o in outs)
    scheduler = serve.get_deployment_handle("scheduler", app_name="specgate")
    verifier = serve.get_deployment_handle("verifier", app_name="specgate")
    replicas = list(scheduler.calls.remote().result())
    assert len(replicas) == 2                           # both replicas were used
    served = {rid: verifier.served_requests.remote(replica=rid).result() for rid in replicas}
    ids = [set(s) for s in served.values()]
    assert ids[0] and ids[1] and not ids[0] & ids[1]    # no request was served by two replicas
    for s in served.values():
        for calls in s.values():
            assert calls.get("prefill", 0) == 1 and calls.get("step", 0) >= 1
    # each replica reports its own KV budget, and the planner plans by both
    kv = scheduler.kv_budgets.remote().result()
    assert set(kv["reported"]) == set(kv["planned"]) == set(replicas)
    assert all(budget > 0 and kv["planned"][rid] == budget
               for rid, (budget, _) in kv["reported"].items())


def test_refusals_keep_their_status_and_openai_body_across_ray(ray_app, model_dir):
    url, _ = ray_app
    with httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as h:
        for stream in (False, True):    # raised in the scheduler replica, answered by the ingress
            r = h.post("/v1/completions", json={"model": "no-such-model", "prompt": "hi", "stream": stream})
            assert r.status_code == 404, r.text
            assert r.json()["error"]["code"] == "model_not_found"
        r = h.post("/v1/completions", json={"model": str(model_dir), "prompt": "hi", "max_tokens": 0})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        r = h.post("/v1/completions", json={"model": str(model_dir), "prompt": "hi"},
                   headers={"Authorization": "Bearer sk-wrong"})
        assert r.status_code == 401
        assert h.get("/ready").status_code == 200
        # /metrics (admin key) on an ingress replica is the scheduler's: requests were counted there
        metrics = h.get("/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
        assert metrics.status_code == 200
        samples = {(x.name, tuple(sorted(x.labels.items()))): x.value
                   for fam in text_string_to_metric_families(metrics.text) for x in fam.samples}
        assert samples[("specgate_requests_total", (("status", "finished"), ("tenant", "t1")))] > 0
        assert samples[("specgate_steps_total", ())] > 0
        # the verifier replicas' prefix caches, as their answers reported them to the scheduler
        assert 0 < samples[("specgate_prefix_cache_bytes", ())] <= samples[
            ("specgate_prefix_cache_capacity_bytes", ())]
        assert [m["id"] for m in h.get("/v1/models").json()["data"]] == [str(model_dir)]
        # refusals count against the tenant's rpm at the ingress, and its 429 in the scheduler's
        # metrics, which /metrics serves
        admin = {"Authorization": f"Bearer {ADMIN}"}
        assert h.post("/admin/tenants", headers=admin, json={
            "name": "metered", "api_keys": ["sk-ray-metered-0123456789"], "rpm": 2}).status_code == 201
        metered = {"Authorization": "Bearer sk-ray-metered-0123456789"}
        r = h.post("/v1/completions", headers=metered, json={"model": "gpt-x", "prompt": "hi"})
        assert r.status_code == 404
        assert h.post("/v1/completions", headers=metered, content=b"{not json").status_code == 400
        r = h.post("/v1/completions", headers=metered, json={"model": str(model_dir), "prompt": "hi"})
        assert r.status_code == 429 and r.json()["error"]["code"] == "rpm_exceeded"
        deadline = time.monotonic() + 30
        while True:
            samples = {(x.name, tuple(sorted(x.labels.items()))): x.value for fam in
                       text_string_to_metric_families(h.get("/metrics", headers=admin).text)
                       for x in fam.samples}
            key = ("specgate_rate_limit_refusals_total", (("reason", "rpm"), ("tenant", "metered")))
            if samples.get(key) == 1 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert samples.get(key) == 1


def test_removing_a_tenant_at_an_ingress_frees_its_caches_on_every_verifier_replica(
        ray_app, model_dir, redis_url):
    """DELETE /admin/tenants/{name} at an ingress replica: the scheduler replica drops the
    tenant's series, and every verifier replica its prefix-cache blocks; a tenant created again
    under the name has another id."""
    url, cfg = ray_app
    admin = {"Authorization": f"Bearer {ADMIN}"}
    registry = TenantRegistry(redis_url, Settings(**cfg.settings).store_prefix)
    verifier = serve.get_deployment_handle("verifier", app_name="specgate")
    scheduler = serve.get_deployment_handle("scheduler", app_name="specgate")
    with httpx.Client(base_url=url, timeout=60) as h:
        key = h.post("/admin/tenants", headers=admin, json={"name": "gone"}).json()["api_key"]
        old = registry.get("gone").id
        r = h.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                   json={"model": str(model_dir), "prompt": PROMPTS[0] * 12, "max_tokens": 4})
        assert r.status_code == 200, r.text
        replicas = list(scheduler.calls.remote().result())

        def blocks() -> int:
            return sum(verifier.tenant_blocks.remote(old, replica=rid).result() for rid in replicas)

        assert blocks() > 0
        assert 'tenant="gone"' in h.get("/metrics", headers=admin).text
        assert h.delete("/admin/tenants/gone", headers=admin).status_code == 200
        deadline = time.monotonic() + 10
        while blocks() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert blocks() == 0
        assert 'tenant="gone"' not in h.get("/metrics", headers=admin).text
        h.post("/admin/tenants", headers=admin, json={"name": "gone"})
        assert registry.get("gone").id != old


def test_the_cluster_keeps_no_secret_though_the_replicas_have_them(ray_app, redis_url, model_dir):
    """Everything Serve's controller keeps in the GCS (its checkpoints: applications, their
    deployments' arguments and options) is read back whole: neither the admin key nor the key
    pepper is in it. Yet the ingress replicas hold both, read from their environment: the admin
    API answers the admin key, and the tenant's key, stored unpeppered before the start, now
    rests peppered (and works)."""
    import redis as redis_py
    from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_list

    url, cfg = ray_app
    kept = b"".join(_internal_kv_get(k, namespace="serve") or b""
                    for k in _internal_kv_list("", namespace="serve"))
    assert str(model_dir).encode() in kept              # the deployments' arguments are in there
    assert ADMIN.encode() not in kept and PEPPER.encode() not in kept
    assert httpx.get(url + "/admin/tenants", headers={"Authorization": f"Bearer {ADMIN}"},
                     timeout=60).status_code == 200
    with redis_py.Redis.from_url(redis_url, decode_responses=True) as r:
        owners = r.hkeys(cfg.settings["store_prefix"] + "tenants:owner")
    assert owners and all(d.startswith("hmac-sha256:") for d in owners)
    assert "sha256:" + hashlib.sha256(KEY.encode()).hexdigest() not in owners
    assert client(url).models.list().data


def test_the_shipped_config_file_validates():
    cfg, http = load_config(CONFIG, {"redis_url": "redis://127.0.0.1:6379/0"})
    assert isinstance(cfg, RayAppConfig) and http["port"] == 8000
    grpc = load_grpc_options(CONFIG, cfg)
    assert grpc["port"] == 9000 and grpc["grpc_servicer_functions"] == [
        "gateway.grpc_api.proto.specgate_pb2_grpc.add_GenerationServicer_to_server"]
    assert cfg.verifier.num_replicas == 2 and cfg.ingress.autoscaling_config["min_replicas"] == 2
    with pytest.raises(ValueError, match="Redis URL"):
        RayAppConfig(settings={"redis_url": None}).gateway_settings()


def test_killing_a_verifier_replica_mid_generation_loses_and_repeats_nothing(ray_app, embedded_url, model_dir):
    """Streams in flight on a replica that is killed finish, token for token as embedded mode
    gives them: their requests are prefilled again elsewhere from what was committed."""
    url, _ = ray_app
    model, prompts, max_tokens = str(model_dir), [p * 4 for p in PROMPTS[:4]], 300
    expected = [client(embedded_url).completions.create(model=model, prompt=p, max_tokens=max_tokens,
                                                        temperature=0).choices[0].text for p in prompts]
    scheduler = serve.get_deployment_handle("scheduler", app_name="specgate")
    started = threading.Barrier(len(prompts) + 1)

    def stream(prompt: str) -> str:
        parts = []
        for i, chunk in enumerate(client(url).completions.create(
                model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True)):
            parts.append(chunk.choices[0].text if chunk.choices else "")
            if i == 2:
                started.wait(60)                     # every stream is under way
        return "".join(parts)

    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(stream, p) for p in prompts]
        started.wait(60)
        homes = scheduler.homes.remote().result()
        victim = Counter(homes.values()).most_common(1)[0][0]
        replaced_before = scheduler.replaced.remote().result()
        name = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                    if a["name"].endswith(f"#verifier#{victim}"))
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        got = [f.result(timeout=120) for f in futures]
    assert got == expected
    assert scheduler.replaced.remote().result() > replaced_before    # the kill did hit live requests


def events(method: str, url: str, body: dict | None = None, stop_after: int | None = None) -> list[dict]:
    """A response's server-sent events, until it ends or `stop_after` text deltas (then the
    client disconnects)."""
    out, deltas = [], 0
    with httpx.stream(method, url, json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(json.loads(line[6:]))
                deltas += out[-1]["type"] == "response.output_text.delta"
                if stop_after is not None and deltas >= stop_after:
                    break
    return out


def delta_text(evs: list[dict]) -> str:
    return "".join(e["delta"] for e in evs if e["type"] == "response.output_text.delta")


def test_killing_the_scheduler_and_ingress_replicas_mid_stream_a_resumed_response_is_whole(
        ray_app, embedded_url, model_dir, redis_url):
    """Background responses streamed through the Ray app; their clients read a few deltas and
    leave, then the scheduler replica and every ingress replica are killed. Serve starts new
    ones; the new scheduler recovers the responses from Redis and finishes them; each client
    resumes with `starting_after` at a new ingress: the text is exactly an uninterrupted run's,
    and every sequence number arrives once. A client-tied completion in flight at the kill is
    cancelled by the new scheduler (nobody can receive it), not run to its end."""
    from gateway.assembly.replica import scheduler_prefix
    from scheduler.request import Status
    from scheduler.store.redis_store import RedisStore

    url, cfg = ray_app
    model, max_tokens = str(model_dir), 64
    inputs = [p * 3 for p in PROMPTS[:3]]
    body = {"model": model, "max_output_tokens": max_tokens, "temperature": 0, "stream": True}
    expected = [delta_text(events("POST", embedded_url + "/v1/responses", {**body, "input": p}))
                for p in inputs]
    scheduler = serve.get_deployment_handle("scheduler", app_name="specgate")
    tied = ThreadPoolExecutor(1).submit(lambda: client(url).completions.create(
        model=model, prompt=PROMPTS[4] * 4, max_tokens=1500, temperature=0))
    before = [events("POST", url + "/v1/responses", {**body, "input": p, "background": True},
                     stop_after=3 + 2 * i) for i, p in enumerate(inputs)]
    live = scheduler.homes.remote().result()
    for name in [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if "#scheduler#" in a["name"] or "#ingress#" in a["name"]]:
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    with pytest.raises(Exception):
        tied.result(timeout=60)
    for evs, want in zip(before, expected):
        rid, last = evs[0]["response"]["id"], evs[-1]["sequence_number"]
        deadline = time.monotonic() + 120
        while True:                                  # until Serve has an ingress replica again
            try:
                after = events("GET", f"{url}/v1/responses/{rid}?stream=true&starting_after={last}")
                break
            except (AssertionError, httpx.HTTPError):
                assert time.monotonic() < deadline
                time.sleep(0.5)
        assert delta_text(evs) + delta_text(after) == want
        assert [e["sequence_number"] for e in evs + after] == list(range(len(evs) + len(after)))
        assert after[-1]["type"] == "response.incomplete"            # max_output_tokens reached
    tied_ids = [rid for rid in live if rid.startswith("cmpl-")]
    assert tied_ids
    reader = RedisStore.from_url(redis_url, scheduler_prefix(Settings(**cfg.settings)))
    try:
        deadline = time.monotonic() + 60
        while (rec := reader.get(tied_ids[0])).stats.status is not Status.CANCELLED:
            assert time.monotonic() < deadline, rec.stats.status
            time.sleep(0.1)
        assert len(rec.output_ids) < 1500
    finally:
        reader.close()


def test_a_rolling_update_that_scales_verifiers_down_mid_generation_drops_no_request(
        ray_app, embedded_url, model_dir):
    """Redeploying with one verifier replica fewer is a rolling update of every deployment: Serve
    drains and stops the old replicas while streams are live. Requests whose KV goes away are
    prefilled again on the replicas left; the new scheduler replica waits for the old one's lease
    before touching any request (two schedulers never step the same requests); every stream
    finishes whole, and every one of them did move. (Token identity across a move is the kill
    test's; over hundreds of tokens of a random model's degenerate loops a recomputed KV may flip
    an fp32 near-tie late in the output, so here the outputs must agree over their first half.)"""
    url, cfg = ray_app
    # Long enough to outlast the old verifier replicas: they stop a few seconds into the update,
    # after some 30 of these tokens (the streams then wait ~20 s for the new replica to start).
    model, prompts, max_tokens = str(model_dir), [p * 4 for p in PROMPTS[1:5]], 400
    expected = [client(embedded_url).completions.create(model=model, prompt=p, max_tokens=max_tokens,
                                                        temperature=0).choices[0].text for p in prompts]
    scheduler = serve.get_deployment_handle("scheduler", app_name="specgate")
    started = threading.Barrier(len(prompts) + 1)

    def stream(prompt: str) -> tuple[str, int, str]:
        parts, usage, reason = [], 0, ""
        for i, chunk in enumerate(client(url).completions.create(
                model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True})):
            if chunk.choices:
                parts.append(chunk.choices[0].text)
                reason = chunk.choices[0].finish_reason or reason
            if chunk.usage:
                usage = chunk.usage.completion_tokens
            if i == 2:
                started.wait(60)
        return "".join(parts), usage, reason

    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(stream, p) for p in prompts]
        started.wait(60)
        homes = scheduler.homes.remote().result()
        assert len(homes) == len(prompts) and len(set(homes.values())) == 2    # spread over both
        smaller = cfg.model_copy(deep=True)
        smaller.verifier.num_replicas = 1
        serve.run(build(smaller), name="specgate", route_prefix="/")        # roll, drain, scale down
        got = [f.result(timeout=180) for f in futures]
    for (text, tokens, reason), ref in zip(got, expected):
        assert (tokens, reason) == (max_tokens, "length")                   # finished, whole
        assert text[: len(ref) // 2] == ref[: len(ref) // 2]
    assert serve.status().applications["specgate"].deployments["verifier"].replica_states.get("RUNNING") == 1
    # the replica left is a new one (every deployment rolled): each stream was prefilled again there
    served = serve.get_deployment_handle("verifier", app_name="specgate").served_requests.remote().result()
    assert all(served.get(rid, {}).get("prefill") == 1 for rid in homes), served
    deadline = time.monotonic() + 60                                        # the new scheduler took over
    while not scheduler.ready.remote().result() and time.monotonic() < deadline:
        time.sleep(0.2)
    out = client(url).completions.create(model=model, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert out.usage.completion_tokens == 8
