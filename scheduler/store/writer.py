"""The step loop's writes to its state store, waiting out an outage.

Nothing is streamed before it is stored (scheduler/loop.py), so a write that fails because the
store does not answer (Redis down, restarting, or past its client's timeout) is retried with
backoff until it goes through: the loop pauses rather than die or skip the write, and every
stream resumes where it paused (a retried write is idempotent: `RedisStore.commit_step`).
"""
from __future__ import annotations

import logging
import threading
import time

from scheduler.store.base import StateStore, StepWrite

log = logging.getLogger(__name__)


class StoreWriter:
    """Commits step writes to `store`, retrying through outages until `stop` is set."""

    def __init__(self, store: StateStore, stop: threading.Event) -> None:
        self.store, self.stop = store, stop
        self.down_since: float | None = None   # monotonic time the current outage began

    def commit(self, write: StepWrite) -> None:
        """Write a step's changes (module docstring). The outage is reported once (a warning
        when it starts, another when it ends, with its length) and is visible while it lasts:
        `down_since` (the step loop's `store_down_since`, hence readiness and the
        `state_store_writes` component of `specgate_component_up`). A bad write (ValueError,
        TypeError) is no outage and raises; so does any failure once the loop is stopping."""
        delay = 0.01
        while True:
            try:
                self.store.commit_step(write)
                if self.down_since is not None:
                    log.warning("state store writes go through again after %.1f s; streams resume",
                                time.monotonic() - self.down_since)
                    self.down_since = None
                return
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
