"""`specgate serve`'s assembly without a model: settings precedence (flags over SPECGATE_* over
defaults), start-up checks, the dev tenant and admin keys, and the embedded gateway over a real
Redis (tenants, limits and scheduler state shared, requests recovered after a restart); on a tiny
model, the step costs the planner is given."""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import time

import httpx
import pytest

from gateway.cli import serve as serve_cmd
from gateway.http.server import background_server
from gateway.builders.embedded import build_embedded
from gateway.service import GenerateInput
from gateway.settings import Settings
from gateway.tenancy.records import Tenant
from scheduler.request import Status


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    serve_cmd.add_arguments(p)
    return p.parse_args(argv)


def test_flags_override_the_environment_which_overrides_defaults(monkeypatch):
    monkeypatch.setenv("SPECGATE_POLICY", "fcfs")
    monkeypatch.setenv("SPECGATE_PORT", "9001")
    monkeypatch.setenv("SPECGATE_DRAFTERS", "ngram, none")
    s = serve_cmd.settings_from_args(parse(["--port", "9002", "--fake-worker"]))
    assert (s.policy, s.port, s.drafter_names, s.fake_worker) == ("fcfs", 9002, ("ngram", "none"), True)
    assert (s.host, s.model, s.grpc_port, s.redis_url) == ("127.0.0.1", "smollm2-135m", None, None)
    s = serve_cmd.settings_from_args(parse(["--policy", "las", "--grpc-port", "0",
                                            "--redis-url", "redis://h:1/0", "--tenants", "t.yaml"]))
    assert (s.policy, s.grpc_port, s.redis_url, str(s.tenants_file)) == ("las", 0, "redis://h:1/0", "t.yaml")


def test_served_model_name_is_a_flag_and_the_id_clients_send(tmp_path):
    """A model given as a path need not be the id clients send: --served-model-name names it,
    /v1/models lists it, and a request naming it is served (the path is not accepted)."""
    s = serve_cmd.settings_from_args(parse(["--fake-worker", "--model", str(tmp_path / "my-model"),
                                            "--served-model-name", "acme-chat"]))
    assert (s.model_id, s.model) == ("acme-chat", str(tmp_path / "my-model"))
    emb = build_embedded(s)
    emb.tenants.put(Tenant("acme"), ["sk-acme-0123456789"])
    emb.start()
    try:
        with background_server(emb.app, log_level="critical") as url:
            h = {"Authorization": "Bearer sk-acme-0123456789"}
            assert [m["id"] for m in httpx.get(url + "/v1/models", headers=h).json()["data"]] == ["acme-chat"]
            ok = httpx.post(url + "/v1/completions", headers=h, timeout=30,
                            json={"model": "acme-chat", "prompt": "hi", "max_tokens": 2})
            assert ok.status_code == 200, ok.text
            by_path = httpx.post(url + "/v1/completions", headers=h, timeout=30,
                                 json={"model": str(tmp_path / "my-model"), "prompt": "hi", "max_tokens": 2})
            assert by_path.status_code == 404 and by_path.json()["error"]["code"] == "model_not_found"
    finally:
        emb.stop()


def test_bad_settings_are_refused_before_anything_loads(monkeypatch):
    with pytest.raises(SystemExit):
        parse(["--policy", "random"])
    with pytest.raises(ValueError, match="unknown drafter 'medusa'"):
        build_embedded(Settings(fake_worker=True, drafters="ngram,medusa"))
    monkeypatch.setenv("SPECGATE_PORT", "not-a-port")
    with pytest.raises(ValueError):
        Settings()


def test_a_fresh_store_gets_a_dev_tenant_and_an_admin_key():
    emb = build_embedded(Settings(fake_worker=True))
    assert emb.dev_key and emb.admin_key
    assert emb.tenants.authenticate(emb.dev_key).name == "dev"
    assert emb.tenants.is_admin(emb.admin_key)
    given = build_embedded(Settings(fake_worker=True, admin_key="sk-mine-admin-key"))
    assert given.admin_key is None and given.tenants.is_admin("sk-mine-admin-key")


def test_the_hidden_fake_worker_flags_stay_out_of_help(capsys):
    with pytest.raises(SystemExit):
        parse(["--help"])
    out = capsys.readouterr().out
    assert "--redis-url" in out and "--fake-worker" not in out


def test_redis_backed_gateway_shares_tenants_and_recovers_requests(redis_url, redis_prefix):
    settings = Settings(fake_worker=True, redis_url=redis_url, store_prefix=redis_prefix)
    first = build_embedded(settings)
    first.tenants.put(Tenant("acme"), ["sk-acme"])

    async def admit(detached: bool):
        # Admitted (persisted) but never stepped: the loop is not started.
        stream = first.service.stream(GenerateInput(Tenant("acme"), "smollm2-135m",
                                                    prompt="left behind", max_tokens=20,
                                                    detached=detached))
        stream.close = lambda: None                    # the "crash": nobody cancels it
        return stream.request_id

    kept, tied = asyncio.run(admit(True)), asyncio.run(admit(False))
    # A second gateway over the same Redis: same tenants, and the requests are taken over: the
    # detached one runs on, the client-tied one (its client is gone with the first) is cancelled.
    second = build_embedded(settings)
    assert second.dev_key is None                      # the store already has tenants
    assert second.recovered == [kept, tied] and second.cancelled == [tied]
    assert second.tenants.authenticate("sk-acme").name == "acme"
    second.start()
    try:
        with background_server(second.app) as url:
            assert httpx.get(url + "/ready").status_code == 200
            r = httpx.post(url + "/v1/completions", headers={"Authorization": "Bearer sk-acme"},
                           json={"model": "smollm2-135m", "prompt": "hi", "max_tokens": 3})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        for _ in range(500):
            rec = second.step_loop.store.get(kept)
            if rec.stats.status is Status.FINISHED:
                break
            asyncio.run(asyncio.sleep(0.01))
        assert rec.stats.status is Status.FINISHED and len(rec.output_ids) == 20
        rec = second.step_loop.store.get(tied)
        assert rec.stats.status is Status.CANCELLED and rec.output_ids == []
    finally:
        second.stop()
        first.step_loop.store.close()


def test_two_gateways_over_one_redis_enforce_one_rate_limit_and_one_concurrency_cap(
        redis_url, redis_prefix):
    # Two replicas (own schedulers, shared tenants and limits), each serving HTTP on loopback.
    a = build_embedded(Settings(fake_worker=True, fake_step_ms=20.0, redis_url=redis_url,
                                store_prefix=redis_prefix, replica_id="a"))
    b = build_embedded(Settings(fake_worker=True, fake_step_ms=20.0, redis_url=redis_url,
                                store_prefix=redis_prefix, replica_id="b"))
    a.tenants.put(Tenant("metered", rpm=3), ["sk-metered"])
    a.tenants.put(Tenant("single", max_concurrent=1), ["sk-single"])
    body = {"model": "smollm2-135m", "prompt": "hi", "max_tokens": 2}
    a.start()
    b.start()
    try:
        with background_server(a.app) as url_a, background_server(b.app) as url_b:
            def post(url, key, **extra):
                return httpx.post(url + "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                                  json={**body, **extra}, timeout=30)

            codes = [post(u, "sk-metered").status_code for u in (url_a, url_b, url_a)]
            assert codes == [200, 200, 200]
            refused = post(url_b, "sk-metered")        # the 4th in the minute, on the other replica
            assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
            assert refused.json()["error"]["type"]

            async def overlap():
                async with httpx.AsyncClient(timeout=30) as client:
                    hdrs = {"Authorization": "Bearer sk-single"}
                    slow = asyncio.create_task(client.post(
                        url_a + "/v1/completions", headers=hdrs, json={**body, "max_tokens": 200}))
                    await asyncio.sleep(0.3)           # a's request is in flight (20 ms a step)
                    other = await client.post(url_b + "/v1/completions", headers=hdrs, json=body)
                    return (await slow).status_code, other.status_code

            first, second = asyncio.run(overlap())
            assert (first, second) == (200, 429)
            assert post(url_b, "sk-single").status_code == 200   # the slot came back
    finally:
        a.stop()
        b.stop()


def test_the_planner_sizes_trees_by_step_costs_measured_here_unless_given_a_profile(tmp_path):
    from gateway.assembly.target import local_target
    from tests.helpers import tiny_model_dir
    from workers.runtime import load_runtime

    model = tiny_model_dir(tmp_path / "tiny")
    rt = load_runtime(str(model), progress=False)
    settings = Settings(model=str(model), max_batch=4)
    measured = local_target(settings, False, rt).step_cost
    assert "start-up" in measured.source and measured.batches == [1, 2, 4]
    assert measured(4, 32) >= measured(4, 4) > 0

    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"source": "mine", "curves": [
        {"batch": 1, "tokens": [1, 8], "step_s": [0.01, 0.02]},
        {"batch": 8, "tokens": [8, 64], "step_s": [0.03, 0.09]}]}))
    given = local_target(Settings(model=str(model), step_profile=path), False, rt).step_cost
    assert given.source == "mine" and given(8, 64) == pytest.approx(0.09)


def test_an_idle_connection_outlives_the_clients_keep_alive():
    # httpx (under the OpenAI SDK and our load generator) drops a pooled connection idle for
    # keepalive_expiry; a server closing idle ones as early would race the client's next request
    async def ok(scope, receive, send):
        if scope["type"] == "lifespan":  # the server runs with lifespan "on", as the gateway does
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    with background_server(ok) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            for pause in (0.0, httpx.Limits().keepalive_expiry + 1):
                time.sleep(pause)
                sock.sendall(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
                answer = b""
                while not answer.endswith(b"ok"):
                    chunk = sock.recv(4096)
                    assert chunk, f"the server closed a connection idle for {pause} s"
                    answer += chunk
                assert answer.startswith(b"HTTP/1.1 200")
