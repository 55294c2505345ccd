"""Waiting for a request's next commit without polling: the readers' half of the state stores'
notification (`StateStore.watch`).

A follower (gateway/replay.py, gateway/responses/service.py) enters `store.watch(request_id)`,
then alternates: read what is new, `wait` for the next commit. Nothing committed between a read
and the wait that follows it can be missed: a commit flags the waiter whenever it comes after the
watch was entered, and `wait` clears the flag as it returns, before the caller's next read (a
commit the read already saw may cost one more read, never a lost wake-up).

Who wakes the waiters:

    memory   the writer's `commit_step` (the step loop's thread), through each waiter's event
             loop (`call_soon_threadsafe`)
    Redis    the writer publishes the ids a commit touched in the commit's own MULTI/EXEC; one
             subscriber per process and event loop hears them (scheduler/store/redis_watch.py)

A waiter holds no thread while it waits: it is an `asyncio.Event` on the follower's event loop.
"""
from __future__ import annotations

import asyncio
import threading
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable, Iterable


class Waiter:
    """One follower's wait for the commits of one request, on the event loop it was made on.
    `wake` and `fail` may be called from any thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._event = asyncio.Event()
        self._error: Callable[[], BaseException] | None = None

    def wake(self) -> None:
        try:
            self._loop.call_soon_threadsafe(self._event.set)
        except RuntimeError:               # its event loop has closed: nobody is waiting
            pass

    def fail(self, error: Callable[[], BaseException]) -> None:
        """The notifications stopped (Redis went away): the next `wait` raises `error()`, at
        once."""
        self._error = error
        self.wake()

    async def wait(self, timeout_s: float) -> bool:
        """Until the request's next commit (True) or `timeout_s` (False). Raises what `fail`
        was given once the notifications have stopped."""
        try:
            await asyncio.wait_for(self._event.wait(), timeout_s)
            woke = True
        except TimeoutError:
            woke = False
        self._event.clear()
        if self._error is not None:
            raise self._error()
        return woke


class Watchers:
    """Request id -> its waiters, for the writer (or a subscriber) to wake. Thread-safe: waiters
    come and go on event loops while the step loop's thread wakes them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_id: dict[str, set[Waiter]] = {}

    def __len__(self) -> int:
        with self._lock:
            return sum(len(w) for w in self._by_id.values())

    def add(self, request_id: str, waiter: Waiter) -> None:
        with self._lock:
            self._by_id.setdefault(request_id, set()).add(waiter)

    def discard(self, request_id: str, waiter: Waiter) -> None:
        with self._lock:
            held = self._by_id.get(request_id)
            if held is not None:
                held.discard(waiter)
                if not held:
                    del self._by_id[request_id]

    def wake(self, request_ids: Iterable[str]) -> None:
        """Wake the waiters of these requests (a commit touched them). O(ids), whoever watches."""
        with self._lock:
            woken = [w for rid in request_ids for w in self._by_id.get(rid, ())]
        for w in woken:
            w.wake()

    def wake_all(self) -> None:
        """Every waiter reads again: notifications may have been lost (a subscriber that has
        just (re)subscribed cannot know what was published while it was not)."""
        for w in self._all():
            w.wake()

    def fail_all(self, error: Callable[[], BaseException]) -> None:
        for w in self._all():
            w.fail(error)

    def _all(self) -> list[Waiter]:
        with self._lock:
            return [w for held in self._by_id.values() for w in held]


@asynccontextmanager
async def watching(watchers: Watchers, request_id: str) -> AsyncIterator[Waiter]:
    """A waiter of `request_id` in `watchers` while the block runs (the running event loop's)."""
    waiter = Waiter(asyncio.get_running_loop())
    watchers.add(request_id, waiter)
    try:
        yield waiter
    finally:
        watchers.discard(request_id, waiter)
