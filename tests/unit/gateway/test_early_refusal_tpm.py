"""Early refusals for tokens per minute (gateway/http/refusal_book.py, "tpm"): a tpm refusal
depends on its request's size, so a key is refused early only while not even one token fits its
tenant's window, and only while every charge that could be refunded is held on this replica,
whose next refund ends the verdict. The limiter's side on both stores; the book on a fake clock;
the gateway on the fake worker over a real Redis, the calls counted on the real tenant registry."""
from __future__ import annotations

import contextlib
import time
from typing import Iterator

import httpx
import pytest

from gateway.http.refusal_book import KINDS, RefusalBook
from gateway.settings import Settings
from gateway.tenancy.limits import LimitExceeded, Limiter
from gateway.tenancy.rates import Closed
from gateway.tenancy.records import Tenant
from tests.helpers import serving
from tests.unit.gateway.test_early_refusals import Clock, Counting, assert_refused

MODEL = "smollm2-135m"
METERED, OTHER = "sk-tpm-metered-000001", "sk-tpm-other-00000001"
TPM = 12                   # 5 s a token: a window filled stays closed to one token for 5 s
PROMPT_TOKENS = 2          # "hi", to the fake worker's tokenizer
REFUNDED_WITHIN_S = 15.0   # a closed stream's release reaches the store within this (usually ms)


def test_a_tpm_refusal_says_how_long_not_even_one_token_fits_and_what_was_live(store):
    url, prefix = store
    limiter, tenant = Limiter(url, prefix), Tenant("tpm-closed", tpm=TPM)
    grant = limiter.acquire(tenant, TPM)                     # the whole window, one grant live
    with pytest.raises(LimitExceeded) as err:
        limiter.precheck(tenant, 2)
    assert err.value.kind == "tpm" and err.value.live == 1
    assert 4.0 < err.value.closed_s <= 60 / TPM             # one token's wait, not two's
    limiter.release(grant, TPM // 2)                         # half of it refunded
    with pytest.raises(LimitExceeded) as err:
        limiter.precheck(tenant, TPM)                        # this one does not fit...
    assert err.value.closed_s == 0 and err.value.live == 0   # ...but a smaller one would


def test_a_tpm_verdict_needs_the_refusals_word_and_ends_with_a_refund_here_or_its_wait():
    clock, refunds = Clock(), {"t": 3}
    book = RefusalBook(lambda _: 0, clock=clock, max_age_s=60.0,
                       refunds=lambda name: refunds.get(name, 0))
    tenant = Tenant("t", tpm=TPM)
    assert not book.note("a", tenant, "tpm", 30.0)                   # its own request's wait only
    assert book.note("d", tenant, "tpm", 30.0, Closed(time.monotonic() + 4.0, refunds=3))
    name, kind, exc = book.refusal("d", KINDS)
    assert (name, kind, exc.kind, exc.retryable) == ("t", "tpm", "tpm", True)
    assert exc.message.startswith(f"Rate limit reached: {TPM} tokens per minute")
    assert 3.0 < exc.retry_after_s <= 4.0                             # the soonest any could fit
    assert book.refusal("d", ("rpm", "followers")) is None            # not a follower's limit
    refunds["t"] = 4                                                  # a release here
    assert book.refusal("d", KINDS) is None
    # a refund seen after the refusal was read, before it was noted: never noted
    assert not book.note("e", tenant, "tpm", 30.0, Closed(time.monotonic() + 4.0, refunds=3))
    assert book.note("f", tenant, "tpm", 30.0, Closed(time.monotonic() + 4.0, refunds=4))
    clock.now += 4.0                                                  # one token fits now
    assert book.refusal("f", KINDS) is None


@contextlib.contextmanager
def gateway(redis_url: str, redis_prefix: str) -> Iterator[tuple]:
    settings = Settings(fake_worker=True, fake_step_ms=300.0, log_level="critical",
                        redis_url=redis_url, store_prefix=redis_prefix, early_refusal_hold_s=0)
    with serving(settings, {"metered": [METERED], "other": [OTHER]},
                 tenant_options={"metered": {"tpm": TPM}}, log_level="critical") as (emb, url):
        book: RefusalBook = emb.app.state.refusal_book
        book._clock = Clock(time.monotonic())      # verdicts age only when the test says
        yield emb, url, book, Counting(emb.tenants, "authenticate")


@pytest.fixture
def gw(redis_url, redis_prefix) -> Iterator[tuple]:
    with gateway(redis_url, redis_prefix) as g:
        yield g


def post(url: str, key: str, max_tokens: int = 1) -> httpx.Response:
    return httpx.post(url + "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                      json={"model": MODEL, "prompt": "hi", "max_tokens": max_tokens}, timeout=60)


@contextlib.contextmanager
def filling_stream(url: str) -> Iterator[None]:
    """A stream of the metered tenant charged its whole window (prompt + max_tokens = its
    tpm), running until the block ends; its end refunds what it did not use."""
    with httpx.Client(timeout=60) as client, client.stream(
            "POST", url + "/v1/completions", headers={"Authorization": f"Bearer {METERED}"},
            json={"model": MODEL, "prompt": "hi", "max_tokens": TPM - PROMPT_TOKENS,
                  "stream": True}) as r:
        assert r.status_code == 200
        chunks = r.iter_raw()        # kept: a generator dropped would close the response
        next(chunks)
        yield


def test_no_token_left_refuses_a_key_early_until_a_refund_here(gw):
    emb, url, book, auth = gw
    grants = emb.service.grants
    with filling_stream(url):
        full = post(url, METERED)                    # refused by the full path, and noted
        assert_refused(full, "tpm_exceeded")
        calls = auth.calls
        for _ in range(3):
            early = post(url, METERED, max_tokens=5)
            assert_refused(early, "tpm_exceeded")
            assert early.json()["error"]["message"].startswith(
                f"Rate limit reached: {TPM} tokens per minute")
            assert int(early.headers["retry-after"]) <= 60 / TPM
        assert auth.calls == calls                   # no thread hop, no Redis: not asked
        assert post(url, OTHER).status_code == 200 and auth.calls == calls + 1
        refunds = grants.refunds("metered")
    deadline = time.monotonic() + REFUNDED_WITHIN_S  # the stream ends: its unused tokens return
    while grants.refunds("metered") == refunds and time.monotonic() < deadline:
        time.sleep(0.02)
    assert grants.refunds("metered") > refunds
    assert post(url, METERED).status_code == 200      # the refund admits it: no verdict stood
    assert auth.calls == calls + 2


def test_a_tpm_refusal_is_not_noted_while_a_charge_is_live_elsewhere(gw):
    # a grant charged on another replica (here: straight to the shared limiter, held by no one
    # here) may be refunded where this replica cannot see it
    emb, url, book, auth = gw
    elsewhere = emb.limiter.acquire(emb.tenants.get("metered"), TPM)
    try:
        for _ in range(2):
            assert_refused(post(url, METERED), "tpm_exceeded")
        assert auth.calls == 2 and len(book) == 0    # both took the full path
    finally:
        emb.limiter.release(elsewhere, 0)
    assert post(url, METERED).status_code == 200
