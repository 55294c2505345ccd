"""Ray mode's scheduler-side pieces without Ray: the routing rule (pure) and the pool's batching.

The pool talks to a deployment handle; here a stand-in handle routes calls to in-process
BatchWorkers on the tiny model by the same rule (`rank_replicas`) Serve's router applies, so the
pool's splitting, ordering, homes and piggybacked releases are checked call by call. The real
thing, on real Ray, is tests/integration/test_ray_serve.py.
"""
from __future__ import annotations

import time
from collections import Counter

import pytest

from gateway.ray_serve.routing import rank_replicas
from gateway.ray_serve.releases import Evicted, apply_releases
from gateway.ray_serve.verifier_pool import CACHE_REPORT_TTL_S, VerifierPool
from workers.contract import SamplingParams
from workers.batch_worker import BatchWorker
from workers.contract import WorkItem
from workers.contract import TreeBudget
from workers.model.llama_forward import LlamaForward
from workers.model.prefix_cache import PrefixCache
from workers.speculation.verifier import Verifier


@pytest.mark.parametrize("replicas, pinned, loads, assigned, expected", [
    (["a", "b"], "b", {"a": 0, "b": 9}, {}, [["b"]]),                 # a pin wins over load
    (["a", "b", "c"], None, {"a": 2, "b": 1}, {}, [["c"], ["b"], ["a"]]),   # fewest resident first
    (["a", "b"], None, {}, {"a": 3, "b": 2}, [["b"], ["a"]]),         # ties: fewest assigned
    (["a", "b"], None, {}, {}, [["a"], ["b"]]),                       # then by id
    (["a", "b"], "dead", {"a": 1}, {}, [["b"], ["a"]]),               # a dead pin: the others
])
def test_rank_replicas(replicas, pinned, loads, assigned, expected):
    assert rank_replicas(replicas, pinned, loads, assigned) == expected


@pytest.mark.parametrize("free, loads, expected", [
    ({"a": 0.1, "b": 0.9}, {"a": 0, "b": 5}, [["b"], ["a"]]),        # most KV room beats fewest requests
    ({"a": 0.5, "b": 0.5}, {"a": 2, "b": 1}, [["b"], ["a"]]),        # equal room: fewest requests
    ({"a": 0.5}, {"b": 9}, [["b"], ["a"]]),                          # no report yet: holds nothing
    (None, {"a": 2, "b": 1}, [["b"], ["a"]]),                        # no reports at all: by loads
])
def test_new_requests_rank_by_free_kv_slots(free, loads, expected):
    assert rank_replicas(["a", "b"], None, loads, free=free) == expected
    assert rank_replicas(["a", "b"], "a", loads, free=free) == [["a"]]      # a pin still wins


def test_doctests_of_the_routing_rule_and_the_per_replica_kv_budget():
    import doctest

    from gateway.assembly import target
    from gateway.ray_serve import routing

    assert doctest.testmod(routing).failed == 0
    assert doctest.testmod(target).failed == 0


def test_affinity_keys_stay_put_and_spread():
    """Rendezvous hashing: a key always prefers one replica; removing another replica does not
    move it; many keys spread over the replicas."""
    replicas = [f"r{i}" for i in range(4)]
    first = {k: rank_replicas(replicas, None, affinity=f"key{k}")[0][0] for k in range(200)}
    assert first == {k: rank_replicas(list(reversed(replicas)), None, affinity=f"key{k}")[0][0] for k in range(200)}
    assert set(first.values()) == set(replicas)
    survivors = [r for r in replicas if r != "r3"]
    for k, top in first.items():
        if top != "r3":
            assert rank_replicas(survivors, None, affinity=f"key{k}")[0][0] == top


class ReplicaGone(Exception):
    """Stands in for Ray's actor-died error."""


class _Response:
    def __init__(self, value):
        self.value = value

    def result(self):
        if isinstance(self.value, ReplicaGone):
            raise self.value
        return self.value


class _Method:
    def __init__(self, handle, name):
        self.handle, self.name = handle, name

    def remote(self, *args, replica=None, loads=None, assigned=None, avoid=(), release=(), free=None,
               prefer=None, **kwargs):
        rid = rank_replicas(list(self.handle.replicas), replica, loads, assigned, avoid, free=free,
                            prefer=prefer)[0][0]
        self.handle.log.append((self.name, rid, args[0] if self.name == "prefill" else None))
        if rid in self.handle.dying:                       # the replica dies under this call
            del self.handle.replicas[rid]
            return _Response(ReplicaGone(rid))
        worker = self.handle.replicas[rid]
        apply_releases(worker, release.get(rid, ()) if isinstance(release, dict) else release)
        if self.name == "prefill":
            done = worker.prefill(*args, **kwargs)
            return _Response({"replica": rid, "busy_s": 0.001, "cached": done.cached,
                              "features": done.features, "kv_tokens": done.kv_tokens,
                              "kv": worker.kv_slots(), "prefix_cache": worker.prefix_cache_usage()})
        if self.name == "step":
            self.handle.step_sizes.append(len(args[0]))
            missing = [i.request_id for i in args[0] if i.request_id not in worker.resident()]
            if missing:
                return _Response({"results": [], "missing": missing, "busy_s": 0.0})
            return _Response({"results": worker.step(args[0]), "missing": [], "busy_s": 0.001,
                              "prefix_cache": worker.prefix_cache_usage(), "kv": worker.kv_slots()})
        apply_releases(worker, args[0])                     # release
        return _Response(None)


class StandInHandle:
    """Routes like KVAffinityRouter over in-process workers named "r0", "r1"."""

    def __init__(self, workers):
        self.replicas = {f"r{i}": w for i, w in enumerate(workers)}
        self.log: list = []
        self.step_sizes: list[int] = []
        self.dying: set[str] = set()         # replicas that die at their next call

    def __getattr__(self, name):
        return _Method(self, name)


@pytest.fixture
def pool_and_workers(tiny_model):
    workers = [BatchWorker(Verifier(LlamaForward(tiny_model))) for _ in range(2)]
    handle = StandInHandle(workers)
    return VerifierPool(handle, context_limit=workers[0].context_limit, lost_errors=(ReplicaGone,)), handle, workers


def prefill(pool, rid, n=6):
    pool.prefill(rid, list(range(5, 5 + n)), prompt_len=n, sampling=SamplingParams(), max_new_tokens=20)


def test_new_requests_spread_and_every_step_goes_home(pool_and_workers):
    pool, handle, workers = pool_and_workers
    for i in range(4):
        prefill(pool, f"q{i}")
    assert Counter(pool.home.values()) == {"r0": 2, "r1": 2}
    items = [WorkItem(f"q{i}", TreeBudget(4, 4)) for i in (3, 0, 2, 1)]
    results = pool.step(items)
    assert [r.request_id for r in results] == ["q3", "q0", "q2", "q1"]    # in item order
    assert sorted(handle.step_sizes) == [2, 2]                            # one call per replica
    steps = [(name, rid) for name, rid, _ in handle.log if name == "step"]
    assert len(steps) == 2 and {rid for _, rid in steps} == {"r0", "r1"}
    for rid, worker in handle.replicas.items():
        assert sorted(worker.resident()) == sorted(q for q, h in pool.home.items() if h == rid)


def test_releases_ride_along_and_idle_replicas_are_flushed(pool_and_workers):
    pool, handle, workers = pool_and_workers
    for i in range(4):
        prefill(pool, f"q{i}")
    gone = [q for q, h in pool.home.items() if h == "r0"]
    for q in gone:
        pool.release(q)
    assert all(q in handle.replicas["r0"].resident() for q in gone)      # no call of its own yet
    calls = len(handle.log)
    pool.step([WorkItem(q, TreeBudget(2, 2)) for q, h in pool.home.items() if h == "r1"])
    assert handle.replicas["r0"].resident() == []                         # flushed in the step
    assert len(handle.log) == calls + 2                                   # one step, one release
    assert set(pool.resident()) == {q for q in pool.home}


def test_a_re_prefill_frees_the_old_home(pool_and_workers):
    pool, handle, workers = pool_and_workers
    prefill(pool, "a")
    prefill(pool, "b")
    old = pool.home["a"]
    prefill(pool, "a", n=8)                    # evicted and planned again: prefilled afresh
    new = pool.home["a"]
    pool.step([WorkItem("a", TreeBudget(2, 2))])
    holders = [rid for rid, w in handle.replicas.items() if "a" in w.resident()]
    assert holders == [new]
    assert old in handle.replicas and (old == new or "a" not in handle.replicas[old].resident())


def run_to_end(pool, ids, steps=12, kill=None):
    """Step `ids` `steps` times (greedy, trees of 4); `kill(step)` may kill replicas. Tokens per id."""
    out = {rid: [] for rid in ids}
    for step in range(steps):
        if kill:
            kill(step)
        for r in pool.step([WorkItem(rid, TreeBudget(4, 4)) for rid in ids]):
            out[r.request_id] += r.tokens
    return out


@pytest.mark.parametrize("how", ["dies_during_a_call", "replaced_between_calls"])
def test_a_lost_replica_costs_no_token(tiny_model, how):
    """Requests on a replica that dies are prefilled again from what was committed and finish with
    exactly the tokens an undisturbed run gives: none missing, none repeated."""
    def fresh():
        workers = [BatchWorker(Verifier(LlamaForward(tiny_model))) for _ in range(2)]
        handle = StandInHandle(workers)
        pool = VerifierPool(handle, context_limit=workers[0].context_limit, lost_errors=(ReplicaGone,))
        ids = [f"q{i}" for i in range(4)]
        for i, rid in enumerate(ids):
            pool.prefill(rid, list(range(5 + i, 17 + i)) * 2, prompt_len=24, sampling=SamplingParams(),
                         max_new_tokens=100)
        return pool, handle, ids

    pool, handle, ids = fresh()
    expected = run_to_end(pool, ids)
    pool, handle, ids = fresh()
    victim = pool.home["q0"]
    victims = {rid for rid, home in pool.home.items() if home == victim}

    def kill(step):
        if step == 5:
            if how == "dies_during_a_call":
                handle.dying.add(victim)
            else:
                del handle.replicas[victim]          # gone; the router sends its calls elsewhere

    got = run_to_end(pool, ids, kill=kill)
    assert got == expected
    assert pool.replaced == len(victims) and victims
    assert set(pool.home.values()) == set(handle.replicas) == {"r0", "r1"} - {victim}
    if how == "dies_during_a_call":
        assert pool.dead == {victim}


def test_an_evicted_request_reaches_its_home_as_evicted_so_drafters_do_not_learn_it(tiny_model):
    """The step loop evicts (KV pressure) through `evict`: the home replica drops the KV, and its
    suffix drafter keeps nothing of the unfinished output; a finished request's output is kept."""
    from workers.drafters.suffix import SuffixDrafter

    workers = [BatchWorker(Verifier(LlamaForward(tiny_model)), drafters={"suffix": SuffixDrafter()})]
    handle = StandInHandle(workers)
    pool = VerifierPool(handle, context_limit=workers[0].context_limit, lost_errors=(ReplicaGone,))
    for rid in ("kept", "moved", "other"):
        pool.prefill(rid, list(range(5, 11)), prompt_len=6, sampling=SamplingParams(),
                     max_new_tokens=20, drafter="suffix")
    pool.step([WorkItem(r, TreeBudget(2, 2)) for r in ("kept", "moved", "other")])
    pool.evict("moved")
    pool.release("kept")
    assert handle.replicas["r0"].resident() == ["kept", "moved", "other"]      # nothing sent yet
    assert [e for e in pool._releases["r0"]] == [Evicted("moved"), "kept"]
    pool.step([WorkItem("other", TreeBudget(2, 2))])                          # they ride along
    assert handle.replicas["r0"].resident() == ["other"]
    suffix = workers[0].drafter("suffix")
    assert len(suffix._tenants["default"].lengths) == 1                       # "kept" only


def test_prefix_cache_usage_sums_the_live_replicas_latest_reports(tiny_model):
    workers = [BatchWorker(Verifier(LlamaForward(tiny_model), prefix_cache=PrefixCache(8, block=4)))
               for _ in range(2)]
    handle = StandInHandle(workers)
    pool = VerifierPool(handle, context_limit=workers[0].context_limit, lost_errors=(ReplicaGone,))
    assert pool.prefix_cache_usage() is None                  # no replica has answered yet
    prefill(pool, "q0", n=9)                                  # 8 tokens of context: two blocks
    prefill(pool, "q1", n=13)                                 # on the other replica: three
    held = [w.verifier.prefix_cache.usage_bytes() for w in workers]
    assert sorted(len(w.verifier.prefix_cache) for w in workers) == [2, 3]
    assert pool.prefix_cache_usage() == (held[0][0] + held[1][0], held[0][1] + held[1][1])
    home = pool.home["q0"]
    handle.dying.add(home)                                    # q0's home dies under the next step
    pool.step([WorkItem("q0", TreeBudget(4, 4)), WorkItem("q1", TreeBudget(4, 4))])
    survivor = next(w for rid, w in handle.replicas.items())
    assert pool.prefix_cache_usage() == survivor.verifier.prefix_cache.usage_bytes()
    # a replica that has not answered for CACHE_REPORT_TTL_S (retired by Serve) drops out
    later = time.monotonic() + CACHE_REPORT_TTL_S + 1
    assert pool.prefix_cache_usage(now=later) is None


def test_the_pool_passes_on_the_replicas_features(tiny_model):
    """Ray mode's length predictor reads the features the verifier replicas compute: from the
    prefill (the prompt's last token) and with every step's results."""
    workers = [BatchWorker(Verifier(LlamaForward(tiny_model), features=True)) for _ in range(2)]
    pool = VerifierPool(StandInHandle(workers), context_limit=workers[0].context_limit,
                        lost_errors=(ReplicaGone,))
    done = pool.prefill("q", [5, 9, 13, 17], prompt_len=4, sampling=SamplingParams(),
                        max_new_tokens=8)
    assert done.cached == 0 and len(done.features) == tiny_model.config.hidden_size
    (res,) = pool.step([WorkItem("q", TreeBudget(0, 0))])
    assert res.features == pytest.approx(done.features, abs=1e-5)   # nothing accepted: the root


def test_new_requests_go_where_kv_room_is_and_the_pool_keeps_each_replicas_budget(tiny_model):
    """Each replica reports its KV pool (budget, held, in slots) with every answer; the pool keeps
    the latest per live replica (`kv_budgets`, what the planner budgets by) and places a new
    request on the replica with the largest share of its pool free, not the one with the fewest
    requests."""
    verifier = Verifier(LlamaForward(tiny_model))
    budget = 2000
    workers = [BatchWorker(Verifier(LlamaForward(tiny_model), kv_pool_bytes=budget * verifier.slot_bytes))
               for _ in range(2)]
    handle = StandInHandle(workers)
    pool = VerifierPool(handle, context_limit=workers[0].context_limit, lost_errors=(ReplicaGone,))
    assert pool.kv_budgets() == {}
    big = pool.prefill("big", [5 + i % 100 for i in range(300)], prompt_len=300, sampling=SamplingParams(),
                       max_new_tokens=20)
    assert big.home == pool.home["big"] == "r0" and big.kv_tokens > 300
    assert pool.kv_budgets() == {"r0": (budget, big.kv_tokens)}
    for rid in ("s1", "s2"):                   # r0 holds one request but far more KV: both go to r1
        prefill(pool, rid)
    assert pool.home == {"big": "r0", "s1": "r1", "s2": "r1"}
    assert pool.kv_budgets() == {name: w.kv_slots() for name, w in handle.replicas.items()}
    # where the planner placed a start (`Plan.homes`), it goes there, whatever the ranking says
    pool.prefill("placed", [5, 6, 7], prompt_len=3, sampling=SamplingParams(), max_new_tokens=4,
                 home="r0")
    assert pool.home["placed"] == "r0"
    pool.release("placed")
    results = pool.step([WorkItem(r, TreeBudget(4, 4)) for r in ("s1", "big", "s2")])
    assert [r.home for r in results] == ["r1", "r0", "r1"]          # each result names its home
    assert pool.kv_budgets() == {name: w.kv_slots() for name, w in handle.replicas.items()}
    handle.dying.add("r1")                     # s1, s2 move to r0; r1's budget is gone
    results = pool.step([WorkItem(r, TreeBudget(4, 4)) for r in ("s1", "big", "s2")])
    assert [r.home for r in results] == ["r0", "r0", "r0"]
    assert pool.kv_budgets() == {"r0": workers[0].kv_slots()}
    # an idle pool still knows the budgets after the reports age (else a burst would start unbounded)
    later = time.monotonic() + CACHE_REPORT_TTL_S + 1
    assert pool.kv_budgets(now=later) == {"r0": workers[0].kv_slots()}


class _DraftCall:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args, **kwargs):
        return _Response(self.fn(*args, **kwargs))


class DraftHandle:
    """The draft deployment, one replica: `propose` and `forget` over a real DraftService."""

    def __init__(self):
        from gateway.ray_serve.draft_pool import DraftService

        self.service = DraftService()
        self.propose = _DraftCall(lambda items, *, drafter, affinity=None, release=():
                                  self.service.propose(items, drafter, release))
        self.forget = _DraftCall(lambda entries, *, drafter, affinity=None:
                                 self.service.forget(entries, drafter))


def test_a_removed_tenant_is_dropped_on_every_replica_and_at_their_draft_replica(tiny_model):
    """`drop_tenant` (a tenant removed at the admin API) reaches every verifier replica at once,
    without waiting for a step: each frees the tenant's prefix-cache blocks, and its remote
    drafter has the draft replica free the tenant's suffix cache."""
    from gateway.ray_serve.draft_pool import RemoteDrafter
    from workers.contract import DraftContext

    draft = DraftHandle()
    workers = [BatchWorker(Verifier(LlamaForward(tiny_model), prefix_cache=PrefixCache(16, block=4)),
                           drafters={"suffix": RemoteDrafter(draft, "suffix", affinity=f"r{i}")})
               for i in range(2)]
    handle = StandInHandle(workers)
    pool = VerifierPool(handle, context_limit=workers[0].context_limit, lost_errors=(ReplicaGone,))
    for rid, tenant in (("q0", "t-1"), ("q1", "t-1"), ("q2", "t-2")):
        pool.prefill(rid, list(range(5, 14)), prompt_len=9, sampling=SamplingParams(),
                     max_new_tokens=8, tenant=tenant, drafter="suffix")
    assert {pool.home["q0"], pool.home["q1"]} == {"r0", "r1"}
    # the draft replica has learnt one finished output of each tenant's
    for rid, tenant in (("d1", "t-1"), ("d2", "t-2")):
        draft.service.propose([(DraftContext(rid, tenant, [1, 2, 3, 4, 5, 6], 2), TreeBudget(0, 0))],
                              "suffix")
        draft.service.forget([rid], "suffix")
    suffix = draft.service.drafters["suffix"]
    kept = suffix.cached_tokens("t-2")
    assert suffix.cached_tokens("t-1") == kept > 0
    assert all(w.verifier.prefix_cache.tenant_len("t-1") == 2 for w in workers)

    pool.drop_tenant("t-1")
    assert [w.verifier.prefix_cache.tenant_len("t-1") for w in workers] == [0, 0]
    assert suffix.cached_tokens("t-1") == 0
    assert suffix.cached_tokens("t-2") == kept                  # another tenant's stays
    assert sum(w.verifier.prefix_cache.tenant_len("t-2") for w in workers) == 2
    assert sorted(r for name, r, _ in handle.log if name == "release") == ["r0", "r1"]
