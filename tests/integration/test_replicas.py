"""Replicas over one Redis, on real processes: `specgate serve` (the fake worker, paced by
`--fake-step-ms`) started and killed with SIGKILL over a redis-server of our own.

    one process per id   a second gateway started with a replica id a live one holds refuses
                         to start, with a clear error; once the holder is killed, the id is
                         free within its lease
    no request left      a killed replica's live requests are adopted by a live replica once
                         its lease runs out, and finish there with exactly their tokens
"""
from __future__ import annotations

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

from gateway.builders.embedded import build_embedded
from gateway.assembly.replica import ReplicaIdHeld
from gateway.settings import Settings
from gateway.tenancy.records import Tenant
from gateway.tenancy.tenants import TenantRegistry
from gateway.http.server import free_port
from scheduler.request import Status
from scheduler.store.redis_store import RedisStore
from test_faults import MODEL, expected_ids

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
LEASE_S = 2.0
KEY = "sk-replicas-0123456789"


def serve(url: str, prefix: str, replica: str, port: int, *, step_ms: float = 20.0,
          stderr=subprocess.DEVNULL) -> subprocess.Popen:
    env = {**os.environ, "SPECGATE_STORE_PREFIX": prefix, "SPECGATE_REPLICA_ID": replica,
           "SPECGATE_REPLICA_LEASE_S": str(LEASE_S), "SPECGATE_LOG_LEVEL": "critical"}
    return subprocess.Popen(
        [sys.executable, "-m", "specgate.cli", "serve", "--fake-worker", "--fake-step-ms",
         str(step_ms), "--redis-url", url, "--port", str(port)], cwd=ROOT, env=env,
        stdout=subprocess.DEVNULL, stderr=stderr, text=True)


def wait_ready(proc: subprocess.Popen, port: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, f"the gateway exited ({proc.returncode})"
        assert time.monotonic() < deadline, "the gateway did not become ready"
        time.sleep(0.1)


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def test_a_held_replica_id_refuses_a_second_gateway_and_is_free_once_its_holder_dies(own_redis):
    prefix = f"rep:{uuid.uuid4().hex}:"
    a_port, b_port = free_port(), free_port()
    a = serve(own_redis.url, prefix, "r1", a_port)
    try:
        wait_ready(a, a_port)
        t0 = time.monotonic()
        b = serve(own_redis.url, prefix, "r1", b_port, stderr=subprocess.PIPE)
        _, err = b.communicate(timeout=60)
        assert b.returncode == 2, err
        assert "replica id 'r1' is held by another running gateway" in err
        assert "Traceback" not in err
        assert time.monotonic() - t0 < 30        # it waited one lease for the holder, no more
        kill(a)
        killed = time.monotonic()
        c = serve(own_redis.url, prefix, "r1", b_port)
        try:
            wait_ready(c, b_port)
            assert time.monotonic() - killed < LEASE_S + 20      # the lease, plus a start
        finally:
            kill(c)
    finally:
        kill(a)


def test_a_killed_replicas_requests_are_adopted_and_finish_on_a_live_one(own_redis):
    prefix, n, max_tokens = f"rep:{uuid.uuid4().hex}:", 4, 300
    TenantRegistry(own_redis.url, prefix).put(Tenant("acme"), [KEY])
    port = free_port()
    a = serve(own_redis.url, prefix, "a", port, step_ms=40.0)
    theirs = RedisStore(redis.Redis.from_url(own_redis.url), f"{prefix}sched:a:")
    clients: list[threading.Thread] = []
    try:
        wait_ready(a, port)

        def client() -> None:                # stays connected until a dies (a gone client cancels)
            try:
                httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                           headers={"Authorization": f"Bearer {KEY}"},
                           json={"model": MODEL, "prompt": "hello", "max_tokens": max_tokens},
                           timeout=60)
            except httpx.HTTPError:
                pass

        clients += [threading.Thread(target=client, daemon=True) for _ in range(n)]
        for t in clients:
            t.start()
        deadline = time.monotonic() + 20
        while len(theirs.load().requests) < n:
            assert time.monotonic() < deadline, "replica a never held the requests"
            time.sleep(0.1)
        time.sleep(0.5)                      # some steps run: output committed before the crash
        kill(a)
        held = {r.request_id: len(r.output_ids) for r in RedisStore(
            redis.Redis.from_url(own_redis.url), f"{prefix}sched:a:").load().requests}
        assert len(held) == n and any(held.values()), held
    finally:
        kill(a)
        for t in clients:
            t.join(10)
    b = build_embedded(Settings(fake_worker=True, fake_step_ms=5.0, redis_url=own_redis.url,
                                store_prefix=prefix, replica_id="b", replica_lease_s=LEASE_S,
                                log_level="critical"))
    b.start()
    try:
        mine = RedisStore(redis.Redis.from_url(own_redis.url), f"{prefix}sched:b:")
        deadline = time.monotonic() + 3 * LEASE_S + 30
        while True:
            recs = {rid: mine.get(rid) for rid in held}
            if all(r is not None and r.stats.status is Status.FINISHED for r in recs.values()):
                break
            assert time.monotonic() < deadline, {k: v and v.stats.status for k, v in recs.items()}
            time.sleep(0.2)
        for rid, rec in recs.items():        # the tokens a committed, then b's: each once
            assert rec.output_ids == expected_ids(rid, max_tokens), rid
        assert RedisStore(redis.Redis.from_url(own_redis.url), f"{prefix}sched:a:").load().requests == []
    finally:
        b.stop()


def test_an_in_process_gateway_with_a_held_id_raises_a_clear_error(own_redis):
    prefix = f"rep:{uuid.uuid4().hex}:"
    settings = Settings(fake_worker=True, redis_url=own_redis.url, store_prefix=prefix,
                        replica_id="x", replica_lease_s=0.5, log_level="critical")
    first = build_embedded(settings)
    first.start()
    try:
        from gateway.assembly.replica import ReplicaLease
        from scheduler.store.redis_client import redis_client
        other = ReplicaLease(redis_client(own_redis.url), prefix, "x", 0.5)   # another process
        with pytest.raises(ReplicaIdHeld, match="replica id 'x' is held"):
            other.acquire()
    finally:
        first.stop()
    other.acquire()                           # released at stop: free at once
    other.release()
