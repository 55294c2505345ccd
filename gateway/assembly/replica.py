"""One process per replica id, and no replica's requests left behind when it dies.

Every embedded gateway over Redis keeps its requests under its replica id
(`<store_prefix>sched:<replica_id>:`, `scheduler_prefix`). Two processes started with the same id
would both recover and step the same requests and trim each other's output lists, so the id is a
lease (`scheduler.lease.Lease`, the one Ray mode's scheduler holds, under the same key):

    start     take the lease, waiting up to one lease time (a crashed holder's runs out); still
              held by a live process: `ReplicaIdHeld`, and the gateway does not start
    hold      renew it every third of the lease; lost to another process (Redis was away for
              longer than the lease and someone took it): the step loop stops, /ready fails
    adopt     every lease time, replicas whose lease is gone but whose requests are still live
              in the store (a pod that died and is not coming back under its id) are taken
              over: this replica takes their lease, moves each live request into its own store
              and step loop (prompt and committed output, as recovery would), and drops it from
              theirs
    stop      release the lease at once (a clean restart need not wait for it to run out)

NOTE: the move is at least once, not exactly once: a replica that dies between writing a request
into its own store and dropping it from the orphan's leaves it in both, and whoever adopts the
second copy runs it again (the first copy's output is not lost, the request is served twice).
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from typing import Any, Callable

from gateway.settings import Settings
from scheduler.lease import Lease
from scheduler.loop import StepLoop
from scheduler.store.redis_store import RedisStore

log = logging.getLogger(__name__)

LEASE_KEY = "lease"          # under the replica's scheduler prefix, as Ray mode's scheduler


def replica_prefix(store_prefix: str, replica_id: str) -> str:
    """Where a replica's scheduler keeps its requests (tenants and limits are shared)."""
    return f"{store_prefix}sched:{replica_id}:"


def scheduler_prefix(settings: Settings) -> str:
    """Where this replica's scheduler keeps its requests (tenants and limits are shared)."""
    return replica_prefix(settings.store_prefix, settings.replica_id)


def lease_key(store_prefix: str, replica_id: str) -> str:
    """The replica id's lease: embedded gateways and Ray mode's scheduler hold the same key."""
    return replica_prefix(store_prefix, replica_id) + LEASE_KEY


class ReplicaIdHeld(ValueError):
    """Another live process holds this replica id's lease (a configuration error: exit 2)."""


def replica_holder() -> str:
    """This process, as the lease records it (host, pid and a nonce: a reused pid is not us)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def acquire_within(lease: Lease, wait_s: float, poll_s: float = 0.2) -> bool:
    """Take `lease`, retrying until `wait_s` have passed (a dead holder's lease runs out)."""
    deadline = time.monotonic() + wait_s
    while True:
        if lease.try_acquire():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)


def orphans(client: Any, store_prefix: str, me: str) -> list[str]:
    """Replica ids other than `me` with live requests in the store and no lease."""
    pattern = replica_prefix(store_prefix, "*") + "live"         # every replica's live set
    head, tail = pattern.split("*")
    found = []
    for key in client.scan_iter(match=pattern, count=500):
        key = key.decode() if isinstance(key, bytes) else key
        rid = key[len(head):-len(tail)]
        if rid and rid != me and ":" not in rid and not client.exists(lease_key(store_prefix, rid)):
            found.append(rid)
    return sorted(found)


class ReplicaLease:
    """This replica's lease over its id, and the adoption of dead replicas' requests."""

    def __init__(self, client: Any, store_prefix: str, replica_id: str, ttl_s: float,
                 *, holder: str | None = None, ended_ttl_s: float | None = None) -> None:
        self.client, self.store_prefix, self.replica_id = client, store_prefix, replica_id
        self.ttl_s = ttl_s
        self.holder = holder or replica_holder()
        self.ended_ttl_s = ended_ttl_s
        self.lease = self._lease(replica_id)
        self.lost = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _lease(self, replica_id: str) -> Lease:
        return Lease(self.client, lease_key(self.store_prefix, replica_id), self.holder, self.ttl_s)

    def acquire(self) -> None:
        """Take the id's lease (waiting up to one lease time), or raise ReplicaIdHeld."""
        if not acquire_within(self.lease, self.ttl_s + 1.0):
            raise ReplicaIdHeld(
                f"replica id {self.replica_id!r} is held by another running gateway over this "
                f"Redis ({self.lease.holder_now() or 'unknown'}): give this one its own "
                f"SPECGATE_REPLICA_ID, or stop the other")

    def hold(self, loop: StepLoop, on_lost: Callable[[], None], alive: Callable[[], bool]) -> None:
        """Renew the lease and adopt orphans on a thread until `release`, while `alive()` (the
        step loop runs: a gateway whose loop died lets its lease run out, as a dead process's
        does); `on_lost` runs once if the lease goes to another process."""
        self._thread = threading.Thread(target=self._run, args=(loop, on_lost, alive),
                                        name="specgate-replica-lease", daemon=True)
        self._thread.start()

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.ttl_s)
        if not self.lost:
            try:
                self.lease.release()
            except Exception:                  # Redis away: the lease runs out by itself
                log.warning("could not release the replica lease; it ends in %.0fs", self.ttl_s)

    def _run(self, loop: StepLoop, on_lost: Callable[[], None], alive: Callable[[], bool]) -> None:
        next_adopt = time.monotonic() + self.ttl_s
        while not self._stop.wait(self.ttl_s / 3) and alive():
            try:
                held = self.lease.renew() or self.lease.try_acquire()
            except Exception:                  # Redis away: keep trying while the lease lasts
                continue
            if not held:
                self.lost = True
                log.error("replica lease for %r taken by %s: this gateway stops stepping",
                          self.replica_id, self.lease.holder_now())
                on_lost()
                return
            if time.monotonic() >= next_adopt:
                next_adopt = time.monotonic() + self.ttl_s
                try:
                    self.adopt_orphans(loop)
                except Exception:
                    log.exception("adopting a dead replica's requests failed; retrying later")

    def adopt_orphans(self, loop: StepLoop) -> list[str]:
        """Take over the live requests of every replica whose lease is gone. Returns their ids."""
        taken: list[str] = []
        for rid in orphans(self.client, self.store_prefix, self.replica_id):
            theirs = self._lease(rid)
            if not theirs.try_acquire():       # another live replica is adopting them
                continue
            try:
                store = RedisStore(self.client, replica_prefix(self.store_prefix, rid),
                                   **({} if self.ended_ttl_s is None else {"ended_ttl_s": self.ended_ttl_s}))
                requests = store.load().requests
                ids = loop.adopt(requests)
                store.hand_over(ids)
                if ids:
                    log.warning("adopted %d request(s) of replica %r, whose lease ran out",
                                len(ids), rid)
                taken += ids
            finally:
                theirs.release()
        return taken
