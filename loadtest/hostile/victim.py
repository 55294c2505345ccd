"""What the hostile load test watches while the attacker works: the victim tenant's steady chat,
a /health probe and a memory sampler, each on a thread of its own, recording plain records
(records.VictimSample, Probe, MemorySample) stamped with `time.monotonic()`.

The victim is open-loop: a short streamed chat every `interval_s`, whatever the earlier ones are
doing, each seeded and greedy, so that a slow gateway shows as longer times, never as fewer
requests. The probe asks GET /health over one keep-alive connection and pauses `interval_s`
after each answer: a probe that waits on a blocked event loop shows that wait as its latency.
"""
from __future__ import annotations

import asyncio
import itertools
import threading
import time
from typing import Any, Callable
from urllib.parse import urlsplit

from loadtest.hostile.bodies import chat_body
from loadtest.hostile.records import (MemorySample, Probe, VictimSample, error_code, event_error,
                                      sse_data)
from loadtest.http_client import HttpClient

VICTIM_PROMPTS = ("Name three colours of the sea.", "What is a lighthouse for?",
                  "Give one tip for a calm morning.", "Say hello to a new neighbour.")
VICTIM_SEED = 50


class _Thread:
    """A loop on a daemon thread until `stop()`."""

    def __init__(self, name: str) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 60.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        raise NotImplementedError


class Victim(_Thread):
    """The victim tenant: one streamed chat every `interval_s` from `start()` to `stop()`; a
    stop waits (up to the request timeout) for those already sent."""

    def __init__(self, url: str, key: str, model: str, *, interval_s: float = 0.5,
                 max_tokens: int = 8, timeout_s: float = 60.0) -> None:
        super().__init__("hostile-victim")
        self.url, self.key, self.model = url, key, model
        self.interval_s, self.max_tokens, self.timeout_s = interval_s, max_tokens, timeout_s
        self.samples: list[VictimSample] = []

    @property
    def in_flight(self) -> int:
        return sum(1 for s in list(self.samples) if s.ended == 0.0)

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        import httpx

        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=self.url, limits=limits, timeout=self.timeout_s) as c:
            tasks, t0 = [], time.monotonic()
            for n in itertools.count():
                at = t0 + n * self.interval_s
                while (wait := at - time.monotonic()) > 0 and not self._stop.is_set():
                    await asyncio.sleep(min(wait, 0.05))
                if self._stop.is_set():
                    break
                sample = VictimSample(at, self.max_tokens)
                self.samples.append(sample)
                body = chat_body(self.model, VICTIM_PROMPTS[n % len(VICTIM_PROMPTS)],
                                 self.max_tokens, stream=True, seed=VICTIM_SEED,
                                 stream_options={"include_usage": True})
                tasks.append(asyncio.ensure_future(self._one(c, body, sample)))
            await asyncio.gather(*tasks)

    async def _one(self, client: Any, body: dict, s: VictimSample) -> None:
        s.started = last = time.monotonic()
        try:
            async with client.stream("POST", "/v1/chat/completions", json=body,
                                     headers={"Authorization": f"Bearer {self.key}"}) as resp:
                s.status = resp.status_code
                if resp.status_code != 200:
                    s.code = error_code(await resp.aread())
                    return
                async for line in resp.aiter_lines():
                    last = self._read(s, line, last)
        except Exception as exc:          # no (whole) answer: a timeout, a dropped connection
            s.code = s.code or type(exc).__name__
        finally:
            s.server_error = s.server_error or s.status >= 500
            s.ended = time.monotonic()

    @staticmethod
    def _read(s: VictimSample, line: str, last: float) -> float:
        """Account one SSE line to `s`; returns the time of the latest content delta."""
        if line.strip() == "data: [DONE]":
            s.done = True
            return last
        event = sse_data(line)
        if (err := event_error(event)) is not None:
            s.code, s.server_error = err
            return last
        if not isinstance(event, dict):
            return last
        if event.get("usage"):
            s.completion_tokens = event["usage"].get("completion_tokens")
        for choice in event.get("choices") or ():
            s.finish_reason = choice.get("finish_reason") or s.finish_reason
            piece = (choice.get("delta") or {}).get("content")
            if piece:
                now = time.monotonic()
                if s.ttft is None:
                    s.ttft = now - s.started
                else:
                    s.gaps.append(now - last)
                s.text += piece
                last = now
        return last


class HealthProbe(_Thread):
    """GET /health, then a pause of `interval_s`, until stopped; a failed probe reconnects."""

    def __init__(self, url: str, interval_s: float = 0.1, timeout_s: float = 30.0) -> None:
        super().__init__("hostile-health")
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.probes: list[Probe] = []
        self._raw = f"GET /health HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n\r\n".encode()

    def _run(self) -> None:
        client = None
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                client = client or HttpClient(self.host, self.port)
                client.sock.settimeout(self.timeout_s)
                client.post(self._raw)                 # any prebuilt request; raises unless 200
                self.probes.append(Probe(t0, time.monotonic() - t0))
            except (OSError, RuntimeError, ConnectionError):
                self.probes.append(Probe(t0, None))
                if client is not None:
                    client.close()
                client = None
            self._stop.wait(self.interval_s)
        if client is not None:
            client.close()


class MemorySampler(_Thread):
    """Redis `used_memory` (`redis_used` returns it, or None) and the gateway's RSS (`rss`)
    every `interval_s`."""

    def __init__(self, redis_used: Callable[[], int | None], rss: Callable[[], int | None],
                 interval_s: float = 1.0) -> None:
        super().__init__("hostile-memory")
        self.redis_used, self.rss, self.interval_s = redis_used, rss, interval_s
        self.samples: list[MemorySample] = []

    def sample(self) -> MemorySample:
        s = MemorySample(time.monotonic(), _quiet(self.redis_used), _quiet(self.rss))
        self.samples.append(s)
        return s

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)


def _quiet(read: Callable[[], int | None]) -> int | None:
    """A sample that fails (Redis not answering, the process gone) is a missing sample."""
    try:
        return read()
    except Exception:
        return None
