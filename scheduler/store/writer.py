"""The step loop's writes to its state store: waiting out an outage, never waiting on a full store.

Nothing is streamed before it is stored (scheduler/loop.py), so a write that fails because the
store does not answer (Redis down, restarting, or past its client's timeout) is retried with
backoff until it goes through: the loop pauses rather than die or skip the write, and every
stream resumes where it paused (a retried write is idempotent: `RedisStore.commit_step`).

A store that answers but is full (`StoreFull`: Redis at `maxmemory`) is another matter: waiting
makes no room (with `noeviction` only an expiry, a deletion or an operator does), and while the
loop waited every tenant's streams would stop. So a refused write is not retried. Its requests'
tokens were not stored, so they cannot be streamed either: `commit` says so, and the loop ends
those requests, failed, with what they had stored (`StateStore.end_requests`, which a full store
still takes). Clients get an error they can retry rather than a stream that hangs; new requests
are refused at the door well before this (scheduler/store/room.py), so it happens only when the
room left for the requests in flight was too small.
"""
from __future__ import annotations

import logging
import threading
import time

from scheduler.store.base import StateStore, StepWrite, StoreFull

log = logging.getLogger(__name__)


class StoreWriter:
    """Commits step writes to `store`, retrying through outages until `stop` is set."""

    def __init__(self, store: StateStore, stop: threading.Event) -> None:
        self.store, self.stop = store, stop
        self.down_since: float | None = None   # monotonic time the current outage began
        self.refused = 0                        # writes a full store refused

    def commit(self, write: StepWrite) -> bool:
        """Write a step's changes (module docstring); False if the store is full and refused a
        write that carried new tokens: nothing of it is stored, and the caller ends the requests
        that made them. A refused write without new tokens still ends the requests it ends
        (`StateStore.end_requests`); the stats and virtual times it carried are written again
        by the next write that goes through.

        An outage is reported once (a warning when it starts, another when it ends, with its
        length) and is visible while it lasts: `down_since` (the step loop's `store_down_since`,
        hence readiness and the `state_store_writes` component of `specgate_component_up`). A
        bad write (ValueError, TypeError) is no outage and raises; so does any failure once the
        loop is stopping."""
        delay, ending = 0.01, False
        while True:
            try:
                if ending:
                    self.store.end_requests(write.ended)
                else:
                    self.store.commit_step(write)
                if self.down_since is not None:
                    log.warning("state store writes go through again after %.1f s; streams resume",
                                time.monotonic() - self.down_since)
                    self.down_since = None
                return True
            except StoreFull as exc:
                if ending:                             # not even that: they stay live, stored
                    log.error("the state store is full and refused to end requests: %s", exc)
                    return True
                self.refused += 1
                if any(write.appended.values()):
                    log.warning("the state store is full and refused a step's write (%s): its "
                                "requests end, failed", exc)
                    return False
                ending = True
                if not write.ended:
                    return True
            except (ValueError, TypeError):            # a bad write, not an outage
                raise
            except Exception as exc:
                if self.stop.is_set():
                    raise
                if self.down_since is None:
                    self.down_since = time.monotonic()
                    log.warning("state store write failed (%s); streams pause, retrying with "
                                "backoff until it answers", exc)
                self.stop.wait(delay)
                delay = min(2 * delay, 0.5)
