"""Redis that stops answering, on real components: the embedded gateway over HTTP (the fake worker
paced by `fake_step_ms`) over a redis-server of our own, paused with SIGSTOP and resumed with
SIGCONT (it accepts connections meanwhile but answers nothing: the hard case for timeouts), and a
gateway process killed with SIGKILL. The shared server is never paused or stopped.

    timeouts         every Redis client the gateway builds fails within its timeout
    off the loop     a new request gets 503 + Retry-After within 2 s; /health stays fast meanwhile
    /ready           goes 503 while Redis does not answer, 200 again when it does
    streams          a stream in flight pauses and resumes with exactly its tokens, each once
    followers        a follower waiting on a request when Redis hangs ends with 503
                     `store_unavailable` within seconds; a new one gets its 503 at once
    slots            renewed past their lease while a stream runs; released after a failed try;
                     a killed gateway's slot frees itself within the short lease
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
import redis

from gateway.assembly.replica import scheduler_prefix
from gateway.builders.embedded import build_embedded
from gateway.http.server import background_server, free_port
from gateway.settings import Settings
from gateway.tenancy.records import Tenant
from gateway.tenancy.tenants import TenantRegistry
from scheduler.request import Request, RequestStats
from scheduler.store.redis_store import RedisStore
from test_faults import TOK, OwnRedis, body, check_refused, check_stored, expected_ids, post

pytestmark = pytest.mark.slow          # as test_faults.py: fault injection, seconds per test

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 1.0          # Settings.redis_timeout_s's default, what these bounds are built on


@contextlib.contextmanager
def paused(server: OwnRedis):
    """SIGSTOP our own redis-server: connections are still accepted (the kernel's backlog), no
    command is answered. SIGCONT however the block ends."""
    server.proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        server.proc.send_signal(signal.SIGCONT)


def gateway(own: OwnRedis, prefix: str, **kw) -> object:
    settings = Settings(fake_worker=True, redis_url=own.url, store_prefix=prefix,
                        log_level="critical", **{"fake_step_ms": 10.0, "replica_id": "r1", **kw})
    return build_embedded(settings)


async def stream_text(client: httpx.AsyncClient, url: str, key: str, max_tokens: int,
                      on_chunk=None) -> tuple[str, str, str]:
    """A streamed completion: (request id, its text, finish_reason); `on_chunk(text so far)` is
    awaited after each chunk."""
    rid, text, reason = None, "", None
    async with client.stream("POST", url + "/v1/completions", json=body(max_tokens, stream=True),
                             headers={"Authorization": f"Bearer {key}"}) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            assert "error" not in data, data
            rid = data["id"]
            choice = data["choices"][0]
            text += choice["text"]
            reason = choice["finish_reason"] or reason
            if on_chunk is not None:
                await on_chunk(text)
    return rid, text, reason


# ---- 1. timeouts on every client ----------------------------------------------------------------
def test_every_redis_client_of_the_gateway_times_out(own_redis):
    emb = gateway(own_redis, f"rf:{uuid.uuid4().hex}:")
    emb.tenants.put(Tenant("acme", rpm=100, max_concurrent=2), ["sk-acme"])
    acme = emb.tenants.get("acme")
    calls = {"state store": lambda: emb.step_loop.store.get("cmpl-x"),
             "tenant registry": lambda: emb.tenants.authenticate("sk-acme"),
             "limiter": lambda: emb.limiter.acquire(acme, 10)}
    try:
        for call in calls.values():
            call()                                   # connected while Redis answers
        with paused(own_redis):
            for name, call in calls.items():
                t0 = time.monotonic()
                with pytest.raises(redis.TimeoutError):
                    call()
                assert time.monotonic() - t0 < TIMEOUT_S + 0.5, name
            t0 = time.monotonic()
            assert not emb.service.ready()           # its ping is bounded too
            assert time.monotonic() - t0 < TIMEOUT_S + 0.5
    finally:
        emb.stop()


async def one_call_while_paused(own: OwnRedis, url: str, call) -> tuple[httpx.Response, float, list[float]]:
    """`call(client)` once with Redis answering (it must succeed: connections open), then once
    while Redis is paused, /health polled every 20 ms until it is answered. Returns that answer,
    its seconds, and each /health's seconds (each must be a 200)."""
    async with httpx.AsyncClient(timeout=30) as client:
        r = await call(client)                                   # warm: connections open
        assert r.status_code == 200, r.text
        with paused(own):
            t0 = time.monotonic()
            req = asyncio.create_task(call(client))
            health = []
            while not req.done():
                h0 = time.monotonic()
                h = await client.get(url + "/health")
                health.append(time.monotonic() - h0)
                assert h.status_code == 200
                await asyncio.sleep(0.02)
            return await req, time.monotonic() - t0, health


# ---- 2. no Redis call on the event loop --------------------------------------------------------------
def test_a_request_while_redis_hangs_gets_503_in_2s_and_health_stays_fast(own_redis):
    emb = gateway(own_redis, f"rf:{uuid.uuid4().hex}:")
    emb.tenants.put(Tenant("acme", rpm=1000, max_concurrent=4), ["sk-acme"])
    emb.start()
    try:
        with background_server(emb.app, log_level="critical") as url:
            refused, refused_s, health = asyncio.run(one_call_while_paused(
                own_redis, url, lambda client: post(client, url, "sk-acme", body(3))))
        check_refused(refused, (503,))
        assert refused.json()["error"]["code"] == "store_unavailable"
        assert refused_s < 2.0, refused_s
        assert len(health) >= 10 and max(health) < 0.25, health   # the loop was never held up
    finally:
        emb.stop()


def test_a_burst_while_redis_hangs_gets_its_503s_in_2s_and_service_resumes(own_redis):
    """Each request that waits on Redis holds a thread for a timeout; a burst of them would
    queue behind the thread pool. Once a ping has failed, new requests are refused at once; when
    Redis answers again, requests are served again within the probe's cache time."""
    emb = gateway(own_redis, f"rf:{uuid.uuid4().hex}:")
    emb.tenants.put(Tenant("acme", rpm=10_000, max_concurrent=64), ["sk-acme"])
    emb.start()
    try:
        with background_server(emb.app, log_level="critical") as url:
            async def scenario():
                async with httpx.AsyncClient(timeout=30) as client:
                    assert (await post(client, url, "sk-acme", body(3))).status_code == 200
                    with paused(own_redis):
                        t0 = time.monotonic()
                        burst = await asyncio.gather(*[post(client, url, "sk-acme", body(3))
                                                       for _ in range(24)])
                        burst_s = time.monotonic() - t0
                    deadline = time.monotonic() + 10
                    while True:
                        r = await post(client, url, "sk-acme", body(3))
                        if r.status_code == 200 or time.monotonic() > deadline:
                            return burst, burst_s, r, time.monotonic() - (t0 + burst_s)
                        await asyncio.sleep(0.1)

            burst, burst_s, after, resumed_s = asyncio.run(scenario())
        for r in burst:
            check_refused(r, (503,))
        assert burst_s < 2.0, burst_s
        assert after.status_code == 200, after.text
        assert resumed_s < 3.0, resumed_s
    finally:
        emb.stop()


def test_admin_auth_while_redis_hangs_gets_503_in_2s_and_health_stays_fast(own_redis):
    """The admin key is checked in Redis too: off the event loop, and a 503 when it hangs."""
    admin = "adm-" + uuid.uuid4().hex
    emb = gateway(own_redis, f"rf:{uuid.uuid4().hex}:", admin_key=admin)
    emb.start()
    try:
        with background_server(emb.app, log_level="critical") as url:
            headers = {"Authorization": f"Bearer {admin}"}
            refused, refused_s, health = asyncio.run(one_call_while_paused(
                own_redis, url, lambda client: client.get(url + "/admin/tenants", headers=headers)))
        check_refused(refused, (503,))
        assert refused_s < 2.0, refused_s
        assert len(health) >= 10 and max(health) < 0.25, health
    finally:
        emb.stop()


def test_the_state_store_write_of_a_new_request_leaves_the_event_loop(own_redis):
    """Tenants in memory and no limiter: the one Redis call a new request makes is the state
    store's `add` at submit, which must run on a thread too."""
    emb = gateway(own_redis, f"rf:{uuid.uuid4().hex}:")
    emb.app.state.tenants = TenantRegistry()                 # in process memory
    emb.app.state.tenants.put(Tenant("acme"), ["sk-acme"])
    emb.service.admission.limiter = None
    emb.start()
    try:
        with background_server(emb.app, log_level="critical") as url:
            refused, refused_s, health = asyncio.run(one_call_while_paused(
                own_redis, url, lambda client: post(client, url, "sk-acme", body(3))))
        check_refused(refused, (503,))
        assert refused_s < 2.0, refused_s
        assert len(health) >= 10 and max(health) < 0.25, health
    finally:
        emb.stop()


# ---- 3. /ready follows Redis --------------------------------------------------------------------------
def test_ready_goes_503_while_redis_does_not_answer_and_back(own_redis):
    emb = gateway(own_redis, f"rf:{uuid.uuid4().hex}:")
    emb.start()
    try:
        with background_server(emb.app, log_level="critical") as url:
            async def until(client, status: int, within_s: float) -> tuple[float, float]:
                """Seconds until /ready answers `status`, and the slowest answer meanwhile."""
                t0, slowest = time.monotonic(), 0.0
                while True:
                    r0 = time.monotonic()
                    r = await client.get(url + "/ready")
                    slowest = max(slowest, time.monotonic() - r0)
                    if r.status_code == status:
                        if status == 503:
                            check_refused(r, (503,))
                        return time.monotonic() - t0, slowest
                    assert time.monotonic() - t0 < within_s, f"/ready never became {status}"
                    await asyncio.sleep(0.05)

            async def scenario():
                async with httpx.AsyncClient(timeout=30) as client:
                    up0 = await until(client, 200, 5)
                    with paused(own_redis):
                        down = await until(client, 503, 4)
                    up = await until(client, 200, 4)
                    return up0, down, up

            _, down, up = asyncio.run(scenario())
        # cached for 1 s, then one ping bounded by the timeout
        assert down[0] < 1.0 + TIMEOUT_S + 1.0 and down[1] < TIMEOUT_S + 0.5, down
        assert up[0] < 1.0 + 1.0, up
    finally:
        emb.stop()


# ---- 4. streams pause and resume, nothing lost -------------------------------------------------------
def test_a_stream_in_flight_pauses_and_resumes_with_each_token_once(own_redis, caplog):
    prefix = f"rf:{uuid.uuid4().hex}:"
    emb = gateway(own_redis, prefix, fake_step_ms=20.0)
    emb.tenants.put(Tenant("acme"), ["sk-acme"])
    max_tokens, pause_s = 80, 2.5
    emb.start()
    caplog.set_level(logging.WARNING, logger="scheduler.store.writer")
    try:
        with background_server(emb.app, log_level="critical") as url:
            async def scenario():
                seen: dict = {"at_pause": None, "during": None, "writing": None, "ready": None}

                async def on_chunk(text: str) -> None:
                    if seen["at_pause"] is None and len(text) >= 10:
                        seen["at_pause"] = text
                        with paused(own_redis):
                            await asyncio.sleep(pause_s)
                            seen["writing"] = emb.step_loop.store_writing()
                            seen["ready"] = (await client.get(url + "/ready")).status_code
                            seen["during"] = emb.step_loop.store_down_since is not None

                async with httpx.AsyncClient(timeout=30) as client:
                    t0 = time.monotonic()
                    out = await stream_text(client, url, "sk-acme", max_tokens, on_chunk)
                    return out, seen, time.monotonic() - t0

            (rid, text, reason), seen, took = asyncio.run(scenario())
        assert seen["at_pause"] is not None and took >= pause_s
        # the outage was seen while it lasted: loop paused, not ready
        assert seen["writing"] is False and seen["during"] and seen["ready"] == 503
        # every token once, in order, to the client and in the store
        assert reason == "length"
        assert text == TOK.decode(expected_ids(rid, max_tokens))
        store = RedisStore.from_url(own_redis.url, scheduler_prefix(emb.settings))
        try:
            check_stored(store, rid, max_tokens)
        finally:
            store.close()
        assert emb.step_loop.store_writing() and emb.loop_alive()
        lines = [r.getMessage() for r in caplog.records if r.name == "scheduler.store.writer"]
        assert sum("streams pause" in m for m in lines) == 1, lines     # reported once
        assert sum("streams resume" in m for m in lines) == 1, lines
    finally:
        emb.stop()


async def follow_until_it_ends(client: httpx.AsyncClient, url: str, key: str, own: OwnRedis,
                               after: int = 3) -> tuple[list, float]:
    """Follow `url` (an SSE stream); once `after` events came, pause Redis and read on until the
    stream ends. Returns the events (JSON, or "[DONE]") and the seconds it took to end."""
    events: list = []
    async with client.stream("GET", url, headers={"Authorization": f"Bearer {key}"}) as r:
        assert r.status_code == 200, await r.aread()
        lines = r.aiter_lines()
        async for line in lines:
            if line.startswith("data: "):
                events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
            if len(events) >= after:
                break
        with paused(own):
            t0 = time.monotonic()
            async for line in lines:
                if line.startswith("data: "):
                    events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
            return events, time.monotonic() - t0


def test_a_wait_on_commits_ends_within_seconds_when_redis_hangs_and_works_once_it_answers(own_redis):
    """The state store's commit notifications (scheduler/store/redis_watch.py) find a Redis that
    stops answering without closing the connection (a PING unanswered), and end every wait on it
    with a Redis error within seconds, though the wait asked for much longer; once Redis answers,
    a new watch is woken by a commit again."""
    prefix = f"rf:{uuid.uuid4().hex}:"
    writer = RedisStore.from_url(own_redis.url, prefix)
    reader = RedisStore.from_url(own_redis.url, prefix)

    async def wait_while_paused() -> float:
        async with reader.watch("r1") as watch:
            await watch.wait(0.1)                 # subscribed: whatever came before, heard
            with paused(own_redis):
                t0 = time.monotonic()
                with pytest.raises(redis.RedisError):
                    await watch.wait(60.0)
                return time.monotonic() - t0

    async def woken_by_a_commit() -> bool:
        async with reader.watch("r2") as watch:
            await watch.wait(0.1)
            req = Request(RequestStats("r2", "acme", 0.0, prompt_len=1, max_tokens=4), [5])
            threading.Timer(0.2, writer.add, args=(req,)).start()
            return await watch.wait(30.0)

    try:
        assert asyncio.run(wait_while_paused()) < 5.0
        assert asyncio.run(woken_by_a_commit())
    finally:
        writer.close()
        reader.close()


def test_a_follower_waiting_while_redis_hangs_ends_with_503_in_seconds(own_redis):
    """A follower waits on the store's commit notifications (no thread held): when Redis stops
    answering, the wait ends within seconds with `store_unavailable` (an error event: the 200 is
    out; the client resumes after Retry-After), for a chat resume and a streamed GET of a
    response alike; a new follower meanwhile gets its 503 with Retry-After at once."""
    emb = gateway(own_redis, f"rf:{uuid.uuid4().hex}:")
    emb.tenants.put(Tenant("acme"), ["sk-acme"])
    headers = {"Authorization": "Bearer sk-acme"}
    emb.start()
    try:
        with background_server(emb.app, log_level="critical") as url:
            async def scenario():
                async with httpx.AsyncClient(timeout=30) as client:
                    model = emb.settings.model_id
                    resp = (await client.post(url + "/v1/responses", headers=headers, json={
                        "model": model, "input": "hi", "max_output_tokens": 3000,
                        "background": True})).json()["id"]
                    async with client.stream("POST", url + "/v1/chat/completions", headers=headers,
                                             json={"model": model, "max_tokens": 3000,
                                                   "messages": [{"role": "user", "content": "hi"}],
                                                   "stream": True,
                                                   "stream_options": {"resumable": True}}) as r:
                        async for line in r.aiter_lines():    # its first event; then it leaves
                            if line.startswith("data: "):
                                chat = json.loads(line[6:])["id"]
                                break
                    followed = {}
                    for name, path in (("response", f"/v1/responses/{resp}?stream=true"),
                                       ("chat", f"/v1/chat/completions/{chat}/stream")):
                        followed[name] = await follow_until_it_ends(client, url + path, "sk-acme",
                                                                     own_redis)
                        await asyncio.sleep(1.5)       # Redis answers again; the probe sees it
                    with paused(own_redis):
                        t0 = time.monotonic()
                        fresh = await client.get(f"{url}/v1/responses/{resp}?stream=true",
                                                 headers=headers)
                        fresh_s = time.monotonic() - t0
                    return resp, chat, followed, fresh, fresh_s

            resp, chat, followed, fresh, fresh_s = asyncio.run(scenario())
            emb.service.cancel(resp)
            emb.service.cancel(chat)
        for name, (events, ended_s) in followed.items():
            errors = [e.get("error", e) for e in events
                      if isinstance(e, dict) and ("error" in e or e.get("type") == "error")]
            assert errors, (name, events[-3:])
            error = errors[-1]
            assert error["code"] == "store_unavailable", (name, error)
            assert ended_s < 5.0, (name, ended_s)
        check_refused(fresh, (503,))
        assert fresh.json()["error"]["code"] == "store_unavailable"
        assert fresh_s < 2.5, fresh_s
    finally:
        emb.stop()


# ---- 5. concurrency slots -----------------------------------------------------------------------------
def test_a_stream_longer_than_its_lease_keeps_its_slot(own_redis):
    emb = gateway(own_redis, f"rf:{uuid.uuid4().hex}:", fake_step_ms=40.0,
                  concurrency_lease_s=1.5)
    emb.tenants.put(Tenant("solo", max_concurrent=1), ["sk-solo"])
    emb.start()
    try:
        with background_server(emb.app, log_level="critical") as url:
            async def scenario():
                async with httpx.AsyncClient(timeout=30) as client:
                    long = asyncio.create_task(post(client, url, "sk-solo",
                                                    body(100, spec=False)))   # ~4 s: 100 steps
                    await asyncio.sleep(3 * 1.5 / 2)  # past its first lease (renewed at 0.5 s…)
                    second = await post(client, url, "sk-solo", body(2))
                    first = await long
                    after = await post(client, url, "sk-solo", body(2))   # released at its end
                    return first, second, after

            first, second, after = asyncio.run(scenario())
        assert first.status_code == 200, first.text
        check_refused(second, (429,))
        assert second.json()["error"]["code"] == "concurrency_exceeded"
        assert after.status_code == 200, after.text
    finally:
        emb.stop()


def test_a_slot_whose_release_failed_is_freed_when_redis_answers(own_redis):
    emb = gateway(own_redis, f"rf:{uuid.uuid4().hex}:", fake_step_ms=20.0)   # lease: 30 s
    emb.tenants.put(Tenant("solo", max_concurrent=1), ["sk-solo"])
    emb.start()
    try:
        with background_server(emb.app, log_level="critical") as url:
            async def scenario():
                async with httpx.AsyncClient(timeout=30) as client:
                    async def leave_while_paused(text: str) -> None:
                        own_redis.proc.send_signal(signal.SIGSTOP)
                        raise ConnectionAbortedError       # the client leaves mid-stream

                    try:
                        with pytest.raises(ConnectionAbortedError):
                            await stream_text(client, url, "sk-solo", 200, leave_while_paused)
                        await asyncio.sleep(2 * TIMEOUT_S)  # the release tried, and failed
                        failed = emb.service.grants.pending()
                    finally:
                        own_redis.proc.send_signal(signal.SIGCONT)
                    t0 = time.monotonic()
                    while True:                            # Redis answers again
                        r = await post(client, url, "sk-solo", body(2))
                        if r.status_code == 200 or time.monotonic() - t0 > 10:
                            return failed, r, time.monotonic() - t0
                        await asyncio.sleep(0.1)

            failed, r, freed_s = asyncio.run(scenario())
        assert failed == 1                                 # waiting for Redis, not dropped
        assert r.status_code == 200, r.text
        assert freed_s < 5, freed_s                        # far sooner than the 30 s lease
        assert emb.service.grants.pending() == 0
    finally:
        emb.stop()


def _serve(own: OwnRedis, prefix: str, port: int, lease_s: float) -> subprocess.Popen:
    env = {**os.environ, "SPECGATE_STORE_PREFIX": prefix, "SPECGATE_REPLICA_ID": "a",
           "SPECGATE_CONCURRENCY_LEASE_S": str(lease_s), "SPECGATE_LOG_LEVEL": "critical"}
    return subprocess.Popen(
        [sys.executable, "-m", "specgate.cli", "serve", "--fake-worker", "--fake-step-ms", "50",
         "--redis-url", own.url, "--port", str(port)], cwd=ROOT, env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_a_killed_gateways_slot_frees_itself_within_the_short_lease(own_redis):
    prefix, lease_s = f"rf:{uuid.uuid4().hex}:", 5.0
    TenantRegistry(own_redis.url, prefix).put(Tenant("solo", max_concurrent=1), ["sk-solo"])
    port = free_port()
    a = _serve(own_redis, prefix, port, lease_s)
    try:
        url_a = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url_a + "/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert a.poll() is None and time.monotonic() < deadline, "gateway A did not start"
            time.sleep(0.1)

        async def crash() -> None:
            async def kill(text: str) -> None:
                a.send_signal(signal.SIGKILL)              # mid-stream, holding its slot
                a.wait()
                raise ConnectionAbortedError

            async with httpx.AsyncClient(timeout=30) as client:
                with pytest.raises(ConnectionAbortedError):
                    await stream_text(client, url_a, "sk-solo", 1000, kill)

        asyncio.run(crash())
        killed_at = time.monotonic()
    finally:
        if a.poll() is None:
            a.kill()
            a.wait()
    b = gateway(own_redis, prefix, replica_id="b", concurrency_lease_s=lease_s)
    b.start()
    try:
        with background_server(b.app, log_level="critical") as url_b:
            async def next_request():
                async with httpx.AsyncClient(timeout=30) as client:
                    first = await post(client, url_b, "sk-solo", body(2))
                    while True:
                        r = await post(client, url_b, "sk-solo", body(2))
                        if r.status_code != 429 or time.monotonic() - killed_at > 4 * lease_s:
                            return first, r, time.monotonic() - killed_at
                        await asyncio.sleep(0.1)

            first, admitted, after_s = asyncio.run(next_request())
        check_refused(first, (429,))                       # the dead gateway's slot still counted
        assert admitted.status_code == 200, admitted.text
        assert after_s <= lease_s + 1.5, after_s           # freed by its lease, not held for long
    finally:
        b.stop()
