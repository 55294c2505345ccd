"""NullStore: a state store that keeps nothing, for a step loop that needs no persistence.

The simulator (tools/sim.py) drives the real step loop over hundreds of thousands of simulated
steps; nothing it does has to survive a restart and nobody follows its requests, so writing each
step into a store (the memory store encodes every record) would only cost time. Every write is
taken and dropped: `load` finds nothing, `get` and `tail` know no request, and a watch is never
woken. Never a serving store: a gateway over it could not resume or fetch anything.
"""
from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Sequence

from scheduler.request import Request, RequestStats
from scheduler.store.base import StepWrite, StoredState, Tail


class _NeverWoken:
    async def wait(self, timeout_s: float) -> bool:
        """Nothing is ever committed here: the wait always runs out."""
        await asyncio.sleep(timeout_s)
        return False


class NullStore:
    """The `StateStore` calls, keeping nothing (module docstring)."""
    remote = False                         # no call waits on anything

    def add(self, req: Request) -> None:
        pass

    def commit_step(self, step: StepWrite) -> None:
        pass

    def end_requests(self, ended: Sequence[RequestStats]) -> None:
        pass

    def load(self) -> StoredState:
        return StoredState(requests=[])

    def get(self, request_id: str) -> Request | None:
        return None

    def tail(self, request_id: str, start: int, *, prompt: bool = False) -> Tail | None:
        return None

    @asynccontextmanager
    async def watch(self, request_id: str) -> AsyncIterator[_NeverWoken]:
        yield _NeverWoken()

    def save_model(self, name: str, doc: dict[str, Any]) -> bool:
        return False                       # not kept

    def load_model(self, name: str) -> dict[str, Any] | None:
        return None

    def close(self) -> None:
        pass
