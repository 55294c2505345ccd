"""Keeping the concurrency slots of requests in flight: renewed while they run, released when
they end, retried while the store does not answer.

A grant's slot is a lease (gateway/tenancy/limits.py): short, so that a gateway that dies frees
its tenants' slots within one lease, and renewed here every third of a lease while its request
runs, so a long stream keeps counting. A release that fails (Redis away or not answering) is not
dropped: it is tried again, with backoff, until it succeeds or the lease has run out by itself
(nothing left to free); otherwise a `max_concurrent` tenant would be refused until then.

The store calls run on the keeper's one thread, never on the caller's: the service calls
`release` from the event loop and awaits the future it returns, so a slot is free before the
client hears that its request ended, and a store that hangs holds up no other request. A limiter
in process memory is released inline (nothing can wait there). The thread starts when there is
work and ends when there is none, so an app built and dropped (tests) leaves nothing running.
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass

from gateway.tenancy.limits import Grant, Limiter

log = logging.getLogger(__name__)

RETRY_FIRST_S = 0.05          # the first wait after a failed store call; doubles each time
RETRY_MAX_S = 1.0             # the longest: a store back is noticed within a second


@dataclass
class _Held:
    grant: Grant
    due: float                # monotonic time of the next renewal
    expires: float            # monotonic time the lease ends unless renewed


@dataclass
class _Release:
    grant: Grant
    used_tokens: int
    expires: float            # past this the slot has freed itself: give up
    done: concurrent.futures.Future


class GrantKeeper:
    def __init__(self, limiter: Limiter) -> None:
        self.limiter = limiter
        self.renew_every_s = limiter.lease_s / 3
        self._cond = threading.Condition()
        self._held: dict[str, _Held] = {}            # grant id -> its lease
        self._by_tenant: Counter[str] = Counter()   # tenant name -> its grants in `_held`
        self._refunds: Counter[str] = Counter()     # tenant name -> its refunds (`refunds`)
        self._releases: list[_Release] = []         # until done (succeeded, or gave up)
        self._down_until = 0.0        # after a failed call: no store call before this (backoff)
        self._delay = RETRY_FIRST_S
        self._outage_logged = False
        self._thread: threading.Thread | None = None

    # ---- any thread ------------------------------------------------------------------------------
    def hold(self, grant: Grant) -> None:
        """Renew `grant` every third of its lease until `release`."""
        now = time.monotonic()
        with self._cond:
            if grant.grant_id not in self._held:
                self._by_tenant[grant.tenant] += 1
            self._held[grant.grant_id] = _Held(grant, now + self.renew_every_s,
                                               now + self.limiter.lease_s)
            self._wake()

    def held(self, tenant: str) -> int:
        """The slots this keeper holds for `tenant`'s requests now: a lower bound on what the
        shared limiter counts for it (gateway/http/refusal_book.py). Any thread; no I/O."""
        return self._by_tenant.get(tenant, 0)

    def snapshot(self, tenant: str) -> tuple[int, int]:
        """(`held`, `refunds`) of `tenant` at one moment. Any thread; no I/O."""
        with self._cond:
            return self._by_tenant.get(tenant, 0), self._refunds.get(tenant, 0)

    def refunds(self, tenant: str) -> int:
        """How many store calls that may have refunded `tenant`'s tokens per minute (a release,
        a correction) this replica has seen answered, or fail: one more means tokens may have
        been freed since (a tpm verdict of the refusal book ends then: gateway/http/
        refusal_book.py). Counted after the call, never before, so that a refusal read from
        the store before a refund landed is always followed by a change here. Any thread."""
        return self._refunds.get(tenant, 0)

    def refunded(self, tenant: str) -> None:
        """A store call that may have refunded `tenant`'s tokens was answered (or failed): the
        releases here count themselves; a correction made elsewhere (gateway/takeover.py) says
        so. Any thread."""
        with self._cond:
            self._refunds[tenant] += 1

    def release(self, grant: Grant, used_tokens: int) -> concurrent.futures.Future:
        """Stop renewing `grant` and free its slot (correcting its TPM charge to `used_tokens`).
        The future is True once the slot is free, False if the first try failed: then it is
        tried again in the background until it succeeds or the lease ends."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            held = self._drop(grant.grant_id)
        if not self.limiter.remote:
            try:
                self.limiter.release(grant, used_tokens)
            finally:
                self.refunded(grant.tenant)
            done.set_result(True)
            return done
        now = time.monotonic()
        expires = held.expires if held is not None else now + self.limiter.lease_s
        with self._cond:
            self._releases.append(_Release(grant, used_tokens, expires, done))
            if now < self._down_until:
                done.set_result(False)               # known down: do not keep the caller waiting
            self._wake()
        return done

    def pending(self) -> int:
        """Releases not done yet (being tried, or waiting for the store to answer)."""
        with self._cond:
            return len(self._releases)

    def _drop(self, grant_id: str) -> _Held | None:
        """(Holding the lock.) Stop keeping a grant; its tenant's count goes down with it."""
        held = self._held.pop(grant_id, None)
        if held is not None:
            left = self._by_tenant[held.grant.tenant] - 1
            if left > 0:
                self._by_tenant[held.grant.tenant] = left
            else:
                del self._by_tenant[held.grant.tenant]
        return held

    # ---- the keeper's thread ---------------------------------------------------------------------
    def _wake(self) -> None:
        """(Holding the lock.) Start the thread if needed, else wake it to look again."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="specgate-grants", daemon=True)
            self._thread.start()
        self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                releases, renewals = self._due(time.monotonic())
                if releases is None:
                    return
            for r in releases:
                self._release(r)
            for h in renewals:
                self._renew(h)

    def _due(self, now: float) -> tuple[list[_Release] | None, list[_Held]]:
        """(Holding the lock.) What to do now, waiting until there is something; (None, [])
        when there is nothing left at all (the thread ends)."""
        while True:
            if not self._held and not self._releases:
                self._thread = None
                return None, []
            if now >= self._down_until:
                renewals = [h for h in self._held.values() if h.due <= now]
                if self._releases or renewals:
                    return list(self._releases), renewals
                wake_at = min(h.due for h in self._held.values())
            else:
                wake_at = self._down_until
            self._cond.wait(max(0.0, wake_at - now))
            now = time.monotonic()

    def _release(self, r: _Release) -> None:
        try:
            self.limiter.release(r.grant, r.used_tokens)
        except Exception as exc:
            self.refunded(r.grant.tenant)       # a call that timed out may have been applied
            if time.monotonic() < r.expires:
                self._failed(exc)                     # kept: tried again once the backoff ends
                _resolve(r.done, False)
                return
            log.warning("tenant %r: gave up releasing a concurrency slot (%s); its lease has "
                        "ended, so it is free anyway", r.grant.tenant, exc)
        else:
            self.refunded(r.grant.tenant)
            self._answered()
        _resolve(r.done, True)
        with self._cond:
            self._releases.remove(r)

    def _renew(self, h: _Held) -> None:
        now = time.monotonic()
        try:
            live = self.limiter.renew(h.grant)
        except Exception as exc:
            self._failed(exc)                         # tried again once the backoff ends
            return
        self._answered()
        with self._cond:
            if self._held.get(h.grant.grant_id) is not h:
                return                                # released meanwhile
            if live:
                h.due, h.expires = now + self.renew_every_s, now + self.limiter.lease_s
            else:
                # Its lease ended (a store outage longer than a lease) or the store lost it: the
                # request runs on, uncounted, rather than be cut off.
                log.warning("tenant %r: a running request's concurrency lease had ended; it is "
                            "no longer counted", h.grant.tenant)
                self._drop(h.grant.grant_id)

    def _failed(self, exc: Exception) -> None:
        with self._cond:
            self._down_until = time.monotonic() + self._delay
            self._delay = min(2 * self._delay, RETRY_MAX_S)
            if not self._outage_logged:
                log.warning("state store did not answer a concurrency-slot call (%s); retrying "
                            "with backoff", exc)
                self._outage_logged = True

    def _answered(self) -> None:
        with self._cond:
            if self._outage_logged:
                log.warning("state store answers again; concurrency-slot calls resumed")
            self._outage_logged = False
            self._delay = RETRY_FIRST_S


def _resolve(done: concurrent.futures.Future, value: bool) -> None:
    if not done.done():
        done.set_result(value)
