"""Any replica answers for any request: embedded replicas over one Redis, read and cancelled as one.

Each embedded replica keeps its requests under its own prefix (`<store_prefix>sched:<id>:`,
gateway/assembly/replica.py), and only its step loop writes or ends them. A client may reach any
replica: a Responses GET, stream, cancel or DELETE, or a chat stream's resume, arrives wherever a
load balancer sends it. So:

    owner     each replica's store records, at `add`, which replica holds a request
              (`<store_prefix>owner:<request id>`, `RedisStore`'s `owner`); an adopter's `add`
              moves it, and it expires with the record
    read      `FleetRecords` is the readers' `RecordReader` (`get`, `tail`, `watch`): this
              replica's store first (one round trip, the common case), else the owner's
    wake      one subscription per process to every replica's commits channel (a pattern):
              a follower here wakes when the owner commits there
    cancel    `FleetRecords.cancel`: this replica's own request is cancelled in its loop; another
              replica's is pushed onto that replica's cancel list (`<its prefix>cancels`), which
              its `CancelInbox` pops (a blocking read on a thread of its own: no polling, and a
              cancel sent while the owner is briefly away waits in the list) into its step loop

Tenancy is decided before any of this, by the caller (a stored response's tenant, a record's
tenant id): a cancel names a request the caller may end.

NOTE: a cancel pushed to a replica that died waits in its list until the list expires
(`CANCEL_TTL_S`); the replica that adopts its requests does not read it, so a request cancelled
in that window runs on to its end there.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Callable

import redis

from gateway import errors
from gateway.assembly.replica import replica_prefix
from scheduler.request import Request
from scheduler.store import StateStore, Tail
from scheduler.store.redis_client import redis_client
from scheduler.store.redis_store import RedisStore
from scheduler.store.redis_watch import RedisCommits, channel_of

log = logging.getLogger(__name__)

CANCELS = "cancels"       # under a replica's prefix: request ids other replicas asked it to end
CANCEL_TTL_S = 3600       # a cancel list nobody pops (its replica gone) is dropped after this
BLOCK_S = 1.0             # the inbox's blocking read returns this often (to see `stop`)


def owners_prefix(store_prefix: str) -> str:
    """Where each request's owner replica is recorded (the store's `owner` key prefix)."""
    return store_prefix + "owner:"


def cancels_key(store_prefix: str, replica_id: str) -> str:
    return replica_prefix(store_prefix, replica_id) + CANCELS


def _glob_escaped(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def commits_pattern(store_prefix: str) -> str:
    """A glob of every replica's commits channel (`channel_of` each replica's prefix)."""
    mark = "\0"
    head, _, tail = replica_prefix(store_prefix, mark).partition(mark)
    return channel_of(_glob_escaped(head) + "*" + _glob_escaped(tail))


class FleetRecords:
    """The readers' view of every replica's requests (module docstring). `local`: this
    replica's own store; `cancel_here(request_id)`: ends one of this replica's requests."""

    remote = True

    def __init__(self, client: Any, store_prefix: str, replica_id: str, local: StateStore,
                 commits: RedisCommits, cancel_here: Callable[[str], None]) -> None:
        self.client, self.store_prefix, self.replica_id = client, store_prefix, replica_id
        self.local, self.commits, self.cancel_here = local, commits, cancel_here
        self._stores: dict[str, RedisStore] = {}

    @classmethod
    def from_url(cls, url: str, store_prefix: str, replica_id: str, local: StateStore,
                 cancel_here: Callable[[str], None], timeout_s: float) -> "FleetRecords":
        return cls(redis_client(url, timeout_s), store_prefix, replica_id, local,
                   RedisCommits(url, "", timeout_s, pattern=commits_pattern(store_prefix)),
                   cancel_here)

    def owner(self, request_id: str) -> str | None:
        """The replica that holds the request (None: unknown or expired). One round trip."""
        held = self.client.get(owners_prefix(self.store_prefix) + request_id)
        return held.decode() if isinstance(held, bytes) else held

    def _theirs(self, request_id: str) -> RedisStore | None:
        """The store of the replica that holds a request this one does not; None if none."""
        owner = self.owner(request_id)
        if owner is None or owner == self.replica_id:
            return None
        store = self._stores.get(owner)
        if store is None:                       # a reader only: its writer's view stays empty
            store = self._stores[owner] = RedisStore(
                self.client, replica_prefix(self.store_prefix, owner))
        return store

    # ---- StateStore's reads ----------------------------------------------------------------------
    def get(self, request_id: str) -> Request | None:
        held = self.local.get(request_id)
        if held is not None:
            return held
        theirs = self._theirs(request_id)
        return theirs.get(request_id) if theirs is not None else None

    def tail(self, request_id: str, start: int, *, prompt: bool = False) -> Tail | None:
        held = self.local.tail(request_id, start, prompt=prompt)
        if held is not None:
            return held
        theirs = self._theirs(request_id)
        return theirs.tail(request_id, start, prompt=prompt) if theirs is not None else None

    def watch(self, request_id: str) -> Any:
        """`StateStore.watch`, woken by whichever replica commits the request."""
        return self.commits.watch(request_id)

    # ---- cancel ------------------------------------------------------------------------------------
    async def cancel(self, request_id: str) -> None:
        """End a request wherever it runs, at its owner's next step boundary (a Redis error:
        the client's 503)."""
        await errors.store_call(True, self.cancel_now, request_id)

    def cancel_now(self, request_id: str) -> None:
        """`cancel`, blocking (any thread)."""
        owner = self.owner(request_id)
        if owner is None or owner == self.replica_id:
            self.cancel_here(request_id)         # ours, or none's: a no-op for an unknown id
            return
        key = cancels_key(self.store_prefix, owner)
        pipe = self.client.pipeline(transaction=True)
        pipe.rpush(key, request_id)
        pipe.expire(key, CANCEL_TTL_S)
        pipe.execute()


class CancelInbox:
    """The owner's side of `FleetRecords.cancel`: pops this replica's cancel list and ends each
    request named there in `cancel_here` (the step loop's `cancel`), on a thread of its own."""

    def __init__(self, url: str, store_prefix: str, replica_id: str,
                 cancel_here: Callable[[str], None], timeout_s: float) -> None:
        # a read blocks up to BLOCK_S: its socket waits that long, and the client's timeout more
        self.client = redis_client(url, timeout_s + BLOCK_S)
        self.key = cancels_key(store_prefix, replica_id)
        self.cancel_here = cancel_here
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="specgate-cancel-inbox",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop popping: at once (the thread ends at its read's next return, within BLOCK_S, and
        closes its client; what it has not popped waits in the list)."""
        self._stop.set()
        self._thread = None

    def _run(self) -> None:
        try:
            self._pop_until_stopped()
        finally:
            self.client.close()

    def _pop_until_stopped(self) -> None:
        away = False
        while not self._stop.is_set():
            try:
                popped = self.client.blpop([self.key], timeout=BLOCK_S)
            except redis.RedisError as exc:     # Redis away: what was pushed waits in the list
                if not away:
                    log.warning("cancel inbox: Redis does not answer (%s); retrying", exc)
                    away = True
                self._stop.wait(BLOCK_S)
                continue
            away = False
            if popped is None:
                continue
            rid = popped[1].decode() if isinstance(popped[1], bytes) else popped[1]
            if self._stop.is_set():             # the loop is stopping: for whoever runs it next
                with contextlib.suppress(redis.RedisError):
                    self.client.lpush(self.key, rid)
                return
            self.cancel_here(rid)
