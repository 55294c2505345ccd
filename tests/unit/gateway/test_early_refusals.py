"""Early refusals (gateway/http/refusal_book.py, gateway/http/early_refusal.py): a key its tenant's
rpm or concurrency refused a moment ago is refused again at the gate, with the same 429, before
authentication (its thread hop and Redis round trip); the verdict ends when the limit can have
changed; it never admits, so a revoked key is a 401 once no verdict stands; other tenants and
keys are untouched. The book's own rules run on a fake clock; the gateway's on the fake worker
over a real Redis, the calls counted on the real tenant registry."""
from __future__ import annotations

import concurrent.futures
import contextlib
import time
from typing import Iterator

import httpx
import pytest

from gateway.http.refusal_book import KINDS, RefusalBook
from gateway.settings import Settings
from gateway.tenancy.records import Tenant
from gateway.tenancy.rates import Verdict, refusal
from tests.helpers import serving

MODEL = "smollm2-135m"
LIMITED, CAPPED, OTHER = "sk-early-limited-0001", "sk-early-capped-00001", "sk-early-other-000001"
RELEASED_WITHIN_S = 15.0       # a closed stream's slot is released within this (usually ms)


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# ---- the book --------------------------------------------------------------------------------------
def test_an_rpm_verdict_lasts_until_the_next_slot_and_counts_its_retry_after_down():
    clock, tenant = Clock(), Tenant("t", rpm=6)
    book = RefusalBook(lambda _: 0, clock=clock, max_age_s=60.0)
    assert book.note("d", tenant, "rpm", 10.0)
    clock.now += 4.0
    name, kind, exc = book.refusal("d", KINDS)
    # the limiter's own words and wait for the same moment
    same = refusal(tenant, 0, Verdict(False, 0.0, "rpm", 6.0))
    assert (name, kind, exc.kind, exc.message, exc.retry_after_s) == ("t", "rpm", "rpm", same.message, 6.0)
    assert book.refusal("other digest", KINDS) is None
    clock.now += 6.0                                   # the slot is free: the verdict is gone
    assert book.refusal("d", KINDS) is None and len(book) == 0


def test_every_verdict_ends_within_max_age_whatever_its_wait():
    clock = Clock()
    book = RefusalBook(lambda _: 5, clock=clock, max_age_s=1.0)
    book.note("r", Tenant("t", rpm=1), "rpm", 59.0)
    book.note("c", Tenant("t", max_concurrent=2), "concurrency", 1.0)
    clock.now += 0.9
    assert book.refusal("r", KINDS)[2].retry_after_s == pytest.approx(58.1)   # still the slot's wait
    assert book.refusal("c", KINDS)[2].kind == "concurrency"
    clock.now += 0.1
    assert book.refusal("r", KINDS) is None and book.refusal("c", KINDS) is None


def test_a_concurrency_verdict_needs_every_slot_held_here_and_ends_when_one_frees():
    held = {"t": 1}
    book = RefusalBook(lambda name: held.get(name, 0), clock=Clock())
    tenant = Tenant("t", max_concurrent=2)
    # one of its two slots is held on another replica: when it frees cannot be seen here
    assert not book.note("d", tenant, "concurrency", 1.0)
    held["t"] = 2
    assert book.note("d", tenant, "concurrency", 1.0)
    assert book.refusal("d", KINDS)[2].message.startswith("Too many concurrent requests: at most 2")
    held["t"] = 1                                      # one of its requests ended here
    assert book.refusal("d", KINDS) is None


def test_only_the_limits_of_a_limited_tenant_are_noted_and_tpm_only_for_every_request():
    book = RefusalBook(lambda _: 9, clock=Clock())
    # a tpm refusal alone is its request's: a smaller one may fit (test_early_refusal_tpm.py)
    assert not book.note("a", Tenant("t", tpm=100), "tpm", 5.0)
    assert not book.note("b", Tenant("t"), "rpm", 5.0)                 # no such limit
    assert not book.note("c", Tenant("t"), "concurrency", 1.0)
    assert not book.note("d", Tenant("t", rpm=5), "rpm", 0.0)          # nothing left to wait
    assert len(book) == 0


def test_the_book_holds_at_most_max_keys_sweeping_the_expired_first():
    clock = Clock()
    book = RefusalBook(lambda _: 0, clock=clock, max_age_s=1.0, max_keys=2)
    tenant = Tenant("t", rpm=1)
    assert book.note("a", tenant, "rpm", 30.0) and book.note("b", tenant, "rpm", 30.0)
    assert not book.note("c", tenant, "rpm", 30.0) and len(book) == 2
    clock.now += 1.0                                   # a and b expired: swept to make room
    assert book.note("c", tenant, "rpm", 30.0) and len(book) == 1


# ---- the gateway -------------------------------------------------------------------------------------
class Counting:
    """Counts the calls of one method of a real object, and makes them."""

    def __init__(self, obj: object, name: str) -> None:
        self.calls, self._real = 0, getattr(obj, name)
        setattr(obj, name, self)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self._real(*args, **kwargs)


@pytest.fixture
def gw(redis_url, redis_prefix) -> Iterator[tuple]:
    settings = Settings(fake_worker=True, fake_step_ms=20.0, log_level="critical",
                        redis_url=redis_url, store_prefix=redis_prefix, early_refusal_hold_s=0)
    with serving(settings, {"limited": [LIMITED], "capped": [CAPPED], "other": [OTHER]},
                 tenant_options={"limited": {"rpm": 1}, "capped": {"max_concurrent": 1}},
                 log_level="critical") as (emb, url):
        book: RefusalBook = emb.app.state.refusal_book
        clock = Clock(time.monotonic())
        book._clock = clock            # verdicts age only when the test says: load-proof
        yield emb, url, book, clock, Counting(emb.tenants, "authenticate")


def post(url: str, key: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                      json={"model": MODEL, "prompt": "hi", "max_tokens": 1, **body}, timeout=60)


def assert_refused(r: httpx.Response, code: str) -> None:
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == code
    assert r.json()["error"]["type"] == "rate_limit_error"
    assert int(r.headers["retry-after"]) >= 1


def test_a_tenant_over_its_rpm_is_refused_without_authenticating_until_its_verdict_ends(gw):
    emb, url, book, clock, auth = gw
    assert post(url, LIMITED).status_code == 200
    full = post(url, LIMITED)                           # the full path refuses, and notes it
    assert_refused(full, "rpm_exceeded")
    assert auth.calls == 2
    for _ in range(5):
        early = post(url, LIMITED)
        assert_refused(early, "rpm_exceeded")
        assert early.json()["error"]["message"].startswith("Rate limit reached: 1 requests per minute")
    assert auth.calls == 2                              # no thread hop, no Redis: not asked
    assert int(early.headers["retry-after"]) <= int(full.headers["retry-after"])
    # another tenant, and any other key, take the full path as before
    assert post(url, OTHER).status_code == 200 and auth.calls == 3
    clock.now += book.max_age_s                         # the verdict ends: asked again
    assert_refused(post(url, LIMITED), "rpm_exceeded")
    assert auth.calls == 4


def test_a_revoked_key_is_a_401_once_no_verdict_stands(gw):
    emb, url, book, clock, auth = gw
    post(url, LIMITED)
    assert_refused(post(url, LIMITED), "rpm_exceeded")
    emb.tenants.remove("limited")
    assert_refused(post(url, LIMITED), "rpm_exceeded")  # within the bound: refused, never admitted
    clock.now += book.max_age_s
    assert post(url, LIMITED).status_code == 401
    assert post(url, "sk-early-never-seen-01").status_code == 401


def test_refusals_are_noted_only_when_the_gate_is_on(redis_url, redis_prefix):
    settings = Settings(fake_worker=True, log_level="critical", redis_url=redis_url,
                        store_prefix=redis_prefix, early_refusals=False)
    with serving(settings, {"limited": [LIMITED]}, tenant_options={"limited": {"rpm": 1}},
                 log_level="critical") as (emb, url):
        auth = Counting(emb.tenants, "authenticate")
        post(url, LIMITED)
        for _ in range(3):
            assert_refused(post(url, LIMITED), "rpm_exceeded")
        assert auth.calls == 4 and len(emb.app.state.refusal_book) == 0


@contextlib.contextmanager
def held_stream(url: str, key: str) -> Iterator[None]:
    """A long stream of `key`'s tenant, holding one concurrency slot until the block ends."""
    with httpx.Client(timeout=60) as client, client.stream(
            "POST", url + "/v1/completions", headers={"Authorization": f"Bearer {key}"},
            json={"model": MODEL, "prompt": "hi", "max_tokens": 3000, "stream": True}) as r:
        assert r.status_code == 200
        chunks = r.iter_raw()       # kept: a generator dropped would close the response
        next(chunks)                                      # it is running
        yield


def test_a_full_tenant_is_refused_early_until_one_of_its_requests_ends_here(gw):
    emb, url, book, clock, auth = gw
    with held_stream(url, CAPPED):
        assert_refused(post(url, CAPPED), "concurrency_exceeded")
        calls = auth.calls
        for _ in range(3):
            assert_refused(post(url, CAPPED), "concurrency_exceeded")
        assert auth.calls == calls
        assert post(url, OTHER).status_code == 200         # another tenant is served
    deadline = time.monotonic() + RELEASED_WITHIN_S
    while emb.service.grants.held("capped") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert emb.service.grants.held("capped") == 0
    assert post(url, CAPPED).status_code == 200             # no verdict outlives the slot
    assert auth.calls == calls + 2



def test_an_early_refusal_is_held_without_holding_the_event_loop(redis_url, redis_prefix):
    # a flood retrying at once gets one refusal per connection per hold, and while refusals are
    # held another tenant is served: the hold is a timer, not work
    hold = 0.8
    settings = Settings(fake_worker=True, fake_step_ms=20.0, log_level="critical",
                        redis_url=redis_url, store_prefix=redis_prefix, early_refusal_hold_s=hold)
    with serving(settings, {"limited": [LIMITED], "other": [OTHER]},
                 tenant_options={"limited": {"rpm": 1}}, log_level="critical") as (emb, url):
        assert post(url, LIMITED).status_code == 200
        assert_refused(post(url, LIMITED), "rpm_exceeded")           # the full path notes it
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            started = time.monotonic()
            held = [pool.submit(post, url, LIMITED) for _ in range(3)]
            other = post(url, OTHER)
            other_s = time.monotonic() - started
            for f in held:
                assert_refused(f.result(), "rpm_exceeded")
            held_s = time.monotonic() - started
        assert other.status_code == 200
        assert held_s >= hold                        # answered no sooner than the hold
        assert other_s < held_s                      # served while the refusals were held
