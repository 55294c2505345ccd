"""The arithmetic of per-tenant rate limits, pure: no store, no clock of its own.

GCRA (the generic cell rate algorithm: a token bucket kept as one number). A limit of `n` per
minute charges each unit `60 / n` seconds of "theoretical arrival time" (TAT); a charge is allowed
when the new TAT is at most one window (60 s) ahead of now. So a tenant may burst its whole
minute's allowance at once and then continues at the steady rate, and a refused caller learns
exactly when to retry. The stores (gateway/tenancy/buckets.py) run these functions in process
memory and, transcribed into Lua, in Redis.

Two moments charge a tenant (gateway/tenancy/limits.py): a request's *arrival* takes one unit of
its requests per minute (`arrival`), before any work on it, whatever becomes of it; its
*admission* takes its tokens per minute and a concurrency slot (`check`), once its prompt is
counted.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.tenancy.records import Tenant

WINDOW_S = 60.0              # RPM and TPM are per minute
CONCURRENCY_RETRY_S = 1.0    # a slot frees when some request ends: we cannot know when
DEFAULT_LEASE_S = 30.0       # short, and renewed while a request runs: a dead gateway's slots free soon
EPS = 1e-6                   # float slack: rpm=7 must allow 7 requests, not 6.999…


class LimitExceeded(Exception):
    """A refusal: `kind` is "rpm", "tpm" or "concurrency"; retry after `retry_after_s` seconds.
    `retryable` False: the request can never fit the limit (more tokens than the whole TPM), so
    waiting is useless and the client must change the request."""

    # A tpm refusal by `Limiter.precheck` also says what holds for every request of its tenant,
    # not only this one (gateway/http/refusal_book.py): `closed_s`, how long not even one token
    # fits unless a charge is refunded first (`tpm_closed_s`; 0: unknown, or one fits now), and
    # `live`, the tenant's grants live in the store when it was read (the charges that could be
    # refunded; None: unknown).
    closed_s: float = 0.0
    live: int | None = None

    def __init__(self, kind: str, retry_after_s: float, message: str,
                 retryable: bool = True) -> None:
        super().__init__(message)
        self.kind, self.retry_after_s, self.message = kind, retry_after_s, message
        self.retryable = retryable

    @property
    def retry_after_header(self) -> str:
        """The value for an HTTP Retry-After header: whole seconds, at least 1."""
        return str(max(1, math.ceil(self.retry_after_s)))


@dataclass(frozen=True)
class Grant:
    """One admitted request: pass it back to `release` (on any replica) when the request ends."""
    tenant: str
    grant_id: str
    tokens: int                  # tokens charged to the TPM bucket at acquire
    tpm: int | None              # the TPM limit charged against (a later change does not matter)
    pool: str = "conc"           # whose slots it holds (only "conc" grants are kept: `to_list`)

    def to_list(self) -> list:
        """As plain JSON (kept with the request, so a restarted gateway can correct it)."""
        return [self.tenant, self.grant_id, self.tokens, self.tpm]

    @classmethod
    def from_list(cls, v: list) -> "Grant":
        tenant, grant_id, tokens, tpm = v
        return cls(str(tenant), str(grant_id), int(tokens), None if tpm is None else int(tpm))


def gcra_take(tat: float, now: float, cost: float, per_minute: int) -> tuple[float | None, float]:
    """Charge `cost` units to a bucket of `per_minute` units per minute whose TAT is `tat`.
    Returns (new TAT, 0.0) if allowed, else (None, seconds until it would be).

    rpm=5: each request costs 12 s. Five requests at t=0 take the TAT to 60 (allowed: 60 - 60 <= 0);
    a sixth would take it to 72, 12 s past the window, so it is refused with retry-after 12.
    >>> gcra_take(60.0, 0.0, 1, 5)
    (None, 12.0)
    >>> gcra_take(60.0, 12.0, 1, 5)
    (72.0, 0.0)
    """
    new_tat = max(tat, now) + cost * WINDOW_S / per_minute
    wait = new_tat - WINDOW_S - now
    return (new_tat, 0.0) if wait <= EPS else (None, wait)


def gcra_adjust(tat: float, now: float, delta: float, per_minute: int) -> float:
    """The TAT after `delta` more units (negative: a refund). A refund never makes the bucket more
    than full (TAT below now).

    tpm=600 (0.1 s per token): 500 tokens charged at t=0 (TAT 50), 100 used: refund 400 -> TAT 10.
    >>> gcra_adjust(50.0, 0.0, -400, 600)
    10.0
    >>> gcra_adjust(50.0, 45.0, -400, 600)   # by t=45 the bucket has refilled past the refund
    45.0
    """
    return max(max(tat, now) + delta * WINDOW_S / per_minute, now)


@dataclass(frozen=True)
class Closed:
    """What a tpm refusal says of every request of its tenant on this replica (gateway/http/
    refusal_book.py): none fits until `until`, unless a charge is refunded first; every charge
    that could be was held here, so a refund comes through this replica's `GrantKeeper`, whose
    count of its tenant's refunds was `refunds` before the store was read."""
    until: float                 # time.monotonic()
    refunds: int


def tpm_closed_s(tenant: Tenant, tpm_tat: float, now: float) -> float:
    """How long no request of `tenant` can fit its tokens per minute, whatever its size: the wait
    of the least any request costs, one token (0: one fits now, or no tpm). The bucket's TAT
    only moves later with time and with charges, so this holds unless a charge is refunded.

    tpm=600 (0.1 s a token), TAT 65 at t=0: one token would take it to 65.1, 5.1 s past the window.
    >>> round(tpm_closed_s(Tenant("t", tpm=600), 65.0, 0.0), 6)
    5.1
    """
    if tenant.tpm is None:
        return 0.0
    new, wait = gcra_take(tpm_tat, now, 1, tenant.tpm)
    return 0.0 if new is not None else wait


@dataclass(frozen=True)
class Usage:
    """What the store holds for one tenant's admissions, as of `now`."""
    tpm_tat: float = 0.0
    live: int = 0                # grants whose lease has not ended


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    tat: float                   # the bucket's TAT to store when allowed (rpm's or tpm's)
    kind: str | None = None      # when refused: the limit that frees last
    retry_after_s: float = 0.0


def arrival(tenant: Tenant, rpm_tat: float, now: float) -> Verdict:
    """One request arriving: its unit of the tenant's requests per minute, or the wait until it
    would fit."""
    if tenant.rpm is None:
        return Verdict(True, rpm_tat)
    new, wait = gcra_take(rpm_tat, now, 1, tenant.rpm)
    return Verdict(True, new) if new is not None else Verdict(False, rpm_tat, "rpm", wait)


def check(tenant: Tenant, usage: Usage, now: float, tokens: int) -> Verdict:
    """Admit one request of `tokens` (estimated) tokens, or name the limit that refuses it. When
    both refuse, the one with the longer wait is named (retrying sooner would be useless); a tie
    goes to tpm. A request larger than the whole TPM can never pass: it is refused as "tpm" with a
    full window's wait, which `refusal` marks not retryable. (Its requests per minute were charged
    when it arrived: `arrival`.)"""
    if tenant.tpm is not None and tokens > tenant.tpm:
        return Verdict(False, usage.tpm_tat, "tpm", WINDOW_S)
    refusals: list[tuple[float, str]] = []
    tpm_tat = usage.tpm_tat
    if tenant.tpm is not None:
        new, wait = gcra_take(usage.tpm_tat, now, tokens, tenant.tpm)
        tpm_tat = new if new is not None else tpm_tat
        if new is None:
            refusals.append((wait, "tpm"))
    if tenant.max_concurrent is not None and usage.live >= tenant.max_concurrent:
        refusals.append((CONCURRENCY_RETRY_S, "concurrency"))
    if refusals:
        wait, kind = max(refusals, key=lambda r: r[0])   # max keeps the first of equals
        return Verdict(False, usage.tpm_tat, kind, wait)
    return Verdict(True, tpm_tat)


def refusal(tenant: Tenant, tokens: int, verdict: Verdict) -> LimitExceeded:
    """The exception for a refused verdict, in words a client can act on (its own limits only)."""
    wait = verdict.retry_after_s
    if verdict.kind == "rpm":
        text = f"Rate limit reached: {tenant.rpm} requests per minute. Try again in {wait:.1f}s."
    elif verdict.kind == "tpm" and tenant.tpm is not None and tokens > tenant.tpm:
        text = (f"Request too large: it may use {tokens} tokens (prompt + max_tokens), more than "
                f"the limit of {tenant.tpm} tokens per minute. Lower max_tokens or shorten the prompt.")
        return LimitExceeded("tpm", wait, text, retryable=False)
    elif verdict.kind == "tpm":
        text = f"Rate limit reached: {tenant.tpm} tokens per minute. Try again in {wait:.1f}s."
    else:
        text = (f"Too many concurrent requests: at most {tenant.max_concurrent} at a time. "
                f"Try again when one finishes.")
    return LimitExceeded(verdict.kind or "rpm", wait, text)
