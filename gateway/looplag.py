"""The event loop's lag, measured where it happens: `specgate_event_loop_lag_seconds`.

Everything a gateway process answers (requests, streams, /health) waits for its event loop, so
work done on the loop (a body parsed, a text decoded, a schema compiled) delays every tenant at
once. A client can only guess at that from its own latencies, which mix in queueing and the
network; the process itself can measure it exactly: a task sleeps `every_s` and records by how
much it overslept, the time the loop was busy with something else. The histogram's buckets say
how often, and its sum how long, the loop was held (the hostile load test reads the difference
across each pattern: loadtest/hostile/).

The task runs for the app's lifespan (gateway/http/app.py); it costs one wake-up per `every_s`.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

from prometheus_client import CollectorRegistry, Histogram

LAG_METRIC = "specgate_event_loop_lag_seconds"
LAG_EVERY_S = 0.1
# from "on time" to "held for seconds": /health's 100 ms target sits between two buckets
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class LoopLag:
    """The lag histogram on `registry`, and the task that feeds it (`running`)."""

    def __init__(self, registry: CollectorRegistry, every_s: float = LAG_EVERY_S) -> None:
        if every_s <= 0:
            raise ValueError("every_s must be > 0")
        self.every_s = every_s
        self.histogram = Histogram(LAG_METRIC, "How late the gateway's event loop woke a task "
                                   f"that slept {every_s:g} s: time it was busy with other work",
                                   buckets=LAG_BUCKETS, registry=registry)

    async def measure(self) -> None:
        """Sleep, record the overshoot, for ever (until cancelled)."""
        loop = asyncio.get_running_loop()
        while True:
            start = loop.time()
            await asyncio.sleep(self.every_s)
            self.histogram.observe(max(0.0, loop.time() - start - self.every_s))

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """The measuring task on the running loop while the block runs."""
        task = asyncio.get_running_loop().create_task(self.measure(), name="specgate-loop-lag")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
