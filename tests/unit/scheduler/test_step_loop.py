"""The step loop with a fake worker: streaming, stop and length, cancellation, eviction, failures,
admission, and restart recovery over the memory store and a real Redis server."""
from __future__ import annotations

import threading
import time

import pytest

from scheduler.admission import AdmissionControl, AdmissionLimits, Refused
from workers.fake_worker import FakeClock, FakeWorker, token_at
from scheduler.loop import Delta, Finished, StepLoop
from scheduler.policies import make_policy
from scheduler.request import Request, RequestStats, Status
from scheduler.alpha import PRIOR_FLOOR
from scheduler.store import MemoryStore, open_store


def request(rid: str, *, tenant: str = "t", max_tokens: int = 20, prompt_len: int = 5,
            stop_token_ids: tuple[int, ...] = (), drafter: str | None = None,
            max_tree_tokens: int | None = None, arrival: float = 0.0) -> Request:
    stats = RequestStats(rid, tenant, arrival, prompt_len=prompt_len, max_tokens=max_tokens,
                         max_tree_tokens=max_tree_tokens)
    return Request(stats, prompt_ids=list(range(10, 10 + prompt_len)), stop_token_ids=stop_token_ids,
                   drafter=drafter)


def truth(rid: str, n: int) -> list[int]:
    return [token_at(rid, p) for p in range(n)]


class Collector:
    """A sink that keeps every event, per request."""

    def __init__(self):
        self.tokens: dict[str, list[int]] = {}
        self.finished: dict[str, Finished] = {}
        self.lock = threading.Lock()

    def __call__(self, event):
        with self.lock:
            if isinstance(event, Delta):
                assert event.request_id not in self.finished, "token after the end"
                self.tokens.setdefault(event.request_id, []).extend(event.token_ids)
            else:
                self.finished[event.request_id] = event


def make_loop(policy="laps", store=None, *, max_batch=4, alpha=0.6, max_resident=8, clock=None,
              worker=None, admission=None, seed=0):
    clock = clock or FakeClock()
    worker = worker or FakeWorker(alpha=alpha, clock=clock, seed=seed)
    pol = make_policy(policy, max_batch=max_batch, token_budget=64, aging_bound_s=None)
    return StepLoop(pol, worker, store, admission=admission, max_resident=max_resident, clock=clock)


def run_to_end(loop: StepLoop, max_steps: int = 10_000) -> None:
    for _ in range(max_steps):
        if not loop.step():
            return
    raise AssertionError("loop did not drain")


@pytest.mark.parametrize("policy", ["fcfs", "sjf", "las", "laps"])
def test_every_request_streams_its_whole_output_exactly_once(policy):
    loop, sink = make_loop(policy, max_batch=3), Collector()
    lengths = {f"r{i}": 5 + 7 * i for i in range(8)}
    for rid, n in lengths.items():
        assert loop.submit(request(rid, max_tokens=n), sink) is not None
    run_to_end(loop)
    for rid, n in lengths.items():
        assert sink.tokens[rid] == truth(rid, n)
        fin = sink.finished[rid]
        assert (fin.status, fin.finish_reason) == (Status.FINISHED, "length")
        assert fin.stats.committed == n and fin.stats.n_steps == len(fin.stats.tau_history)
    assert loop.worker.resident() == [] and loop.admission.live == 0


def test_stop_token_ends_the_request_and_nothing_after_it_is_streamed():
    rid = "stopper"
    stop_at = 6
    stop_token = token_at(rid, stop_at)
    assert stop_token not in truth(rid, stop_at)
    loop, sink = make_loop(alpha=0.9), Collector()
    loop.submit(request(rid, max_tokens=50, stop_token_ids=(stop_token,)), sink)
    run_to_end(loop)
    assert sink.tokens[rid] == truth(rid, stop_at + 1)      # the stop token itself is the last
    assert sink.finished[rid].finish_reason == "stop"


def test_speculation_switch_and_tenant_tree_cap_bound_every_budget():
    worker = FakeWorker(alpha=0.9)
    seen = []
    real_step = worker.step

    def spy(items):
        seen.extend(items)
        return real_step(items)

    worker.step = spy
    loop = make_loop(worker=worker)
    loop.submit(request("off", drafter="none", max_tokens=30))
    loop.submit(request("capped", max_tree_tokens=2, max_tokens=30))
    run_to_end(loop)
    assert all(not i.budget.speculates for i in seen if i.request_id == "off")
    assert all(i.budget.max_nodes <= 2 for i in seen if i.request_id == "capped")
    assert any(i.budget.max_nodes == 2 for i in seen if i.request_id == "capped")


def test_a_new_request_starts_from_what_its_tenant_showed_of_its_drafter():
    """The loop records each request's drafter, and the planner's learned prior goes by (tenant,
    drafter): after a request whose drafts were mostly rejected, the same tenant's next request
    with that drafter starts from a low α (at the floor); another drafter's, or another tenant's,
    from 3 : 1."""
    loop = make_loop(worker=FakeWorker(alpha=0.1))
    loop.submit(request("first", drafter="d", max_tokens=60))
    run_to_end(loop)
    late = {rid: request(rid, tenant=t, drafter=d, max_tokens=5)
            for rid, t, d in (("same", "t", "d"), ("other-drafter", "t", "e"), ("other-tenant", "u", "d"))}
    for r in late.values():
        loop.submit(r)
    loop.step()                                                # the inbox is applied at a step
    assert late["same"].stats.drafter == "d"
    assert late["same"].stats.estimate.prior == PRIOR_FLOOR
    assert late["other-drafter"].stats.estimate.prior == late["other-tenant"].stats.estimate.prior == 0.75


def test_cancellation_frees_the_kv_within_one_step():
    loop, sink = make_loop(max_batch=4), Collector()
    for i in range(3):
        loop.submit(request(f"r{i}", max_tokens=200), sink)
    for _ in range(3):
        loop.step()
    assert "r1" in loop.worker.resident()
    loop.cancel("r1")
    loop.step()                                                # the next boundary applies it
    assert "r1" not in loop.worker.resident()
    assert "r1" not in loop.worker.batches[-1]
    fin = sink.finished["r1"]
    assert (fin.status, fin.finish_reason) == (Status.CANCELLED, "abort")
    got = sink.tokens["r1"]
    assert got == truth("r1", len(got))                        # what was streamed stays valid
    assert loop.store.get("r1").stats.status is Status.CANCELLED
    run_to_end(loop)
    assert set(sink.finished) == {"r0", "r1", "r2"}


def test_cancelling_a_queued_request_never_runs_it():
    loop, sink = make_loop(max_batch=1), Collector()
    loop.submit(request("a", max_tokens=10), sink)
    loop.submit(request("b", max_tokens=10), sink)
    loop.cancel("b")
    run_to_end(loop)
    assert all("b" not in batch for batch in loop.worker.batches)
    assert "b" not in sink.tokens and sink.finished["b"].status is Status.CANCELLED


def test_kv_beyond_max_resident_is_evicted_and_rebuilt_from_committed_tokens():
    # las preempts after the first quantum, so 6 long requests rotate through a batch of 2 while
    # only 3 may hold KV: evicted ones are re-prefilled with prompt + committed output.
    loop, sink = make_loop("las", max_batch=2, max_resident=3, alpha=0.5), Collector()
    for i in range(6):
        loop.submit(request(f"r{i}", max_tokens=120), sink)
    while loop.step():
        assert len(loop.worker.resident()) <= 3
    reprefills = [(rid, n) for rid, n in loop.worker.prefills if n > 5]
    assert reprefills, "nothing was evicted: the test does not exercise eviction"
    for i in range(6):
        assert sink.tokens[f"r{i}"] == truth(f"r{i}", 120)


def test_a_failing_step_fails_its_batch_and_the_loop_goes_on():
    worker = FakeWorker(fail_on=lambda items: any(i.request_id == "bad" for i in items))
    loop, sink = make_loop("fcfs", worker=worker, max_batch=1), Collector()
    loop.submit(request("bad"), sink)
    loop.submit(request("good"), sink)
    run_to_end(loop)
    assert sink.finished["bad"].status is Status.FAILED
    assert sink.finished["bad"].finish_reason == "error" and "step failed" in sink.finished["bad"].error
    assert sink.tokens["good"] == truth("good", 20)


def test_bad_requests_raise_and_full_queues_refuse_without_dropping_anyone():
    limits = AdmissionLimits(max_live=3, max_live_per_tenant=2)
    loop, sink = make_loop(admission=AdmissionControl(limits)), Collector()
    with pytest.raises(ValueError, match="empty"):
        loop.submit(request("e", prompt_len=0))
    with pytest.raises(ValueError, match="max_tokens"):
        loop.submit(request("z", max_tokens=0))
    with pytest.raises(ValueError, match="context"):
        loop.submit(request("long", prompt_len=5000))
    verdicts = [loop.submit(request(f"a{i}", tenant="a"), sink) for i in range(3)]
    assert isinstance(verdicts[2], Refused) and verdicts[2].http_status == 429
    loop.submit(request("b0", tenant="b"), sink)
    full = loop.submit(request("c0", tenant="c"), sink)
    assert isinstance(full, Refused) and full.http_status == 503 and full.retry_after_s > 0
    run_to_end(loop)
    assert set(sink.finished) == {"a0", "a1", "b0"}            # every admitted one finished
    assert loop.submit(request("c1", tenant="c"), sink) is not None and not isinstance(
        loop.submit(request("c2", tenant="c"), sink), Refused)


def test_the_loop_thread_serves_submissions_from_other_threads():
    loop, sink = make_loop(clock=time.time, worker=FakeWorker(alpha=0.5)), Collector()
    loop.start()
    try:
        threads = [threading.Thread(target=loop.submit, args=(request(f"r{i}", max_tokens=15), sink))
                   for i in range(10)]
        for t in threads:
            t.start()
        deadline = time.time() + 10
        while len(sink.finished) < 10 and time.time() < deadline:
            time.sleep(0.01)
    finally:
        loop.stop()
    assert len(sink.finished) == 10
    assert all(sink.tokens[f"r{i}"] == truth(f"r{i}", 15) for i in range(10))


# ---- restart recovery -------------------------------------------------------------------------
def _crash_midway(store_a, store_b, *, steps_before: int = 6):
    """Run loop A for a few steps, drop it without any cleanup, recover with loop B over store B
    (the same state), and return what the clients saw from each."""
    clock = FakeClock()
    a, seen_a = make_loop("laps", store_a, max_batch=3, clock=clock), Collector()
    for i in range(7):
        a.submit(request(f"r{i}", max_tokens=30 + 5 * i, arrival=clock.now), seen_a)
    for _ in range(steps_before):
        a.step()
    running = {r for r, t in seen_a.tokens.items() if r not in seen_a.finished}
    queued = {f"r{i}" for i in range(7)} - set(seen_a.tokens)
    assert running and queued, "the crash must hit requests mid-generation and queued ones"

    b, seen_b = make_loop("laps", store_b, max_batch=3, clock=clock, seed=1), Collector()
    recovered = b.recover()
    assert sorted(recovered) == sorted(running | queued)       # finished ones are not re-run
    for rid in recovered:
        b.attach(rid, seen_b)
    run_to_end(b)
    return seen_a, seen_b, b


def _check_recovery(seen_a, seen_b, b):
    for i in range(7):
        rid, n = f"r{i}", 30 + 5 * i
        before, after = seen_a.tokens.get(rid, []), seen_b.tokens.get(rid, [])
        assert before + after == truth(rid, n)                 # nothing lost, nothing re-sent
        done = seen_a.finished.get(rid) or seen_b.finished.get(rid)
        assert done.status is Status.FINISHED and done.stats.committed == n
        assert b.store.get(rid).output_ids == truth(rid, n)
    # A re-prefill covers prompt + what was committed before the crash.
    for rid, n in b.worker.prefills:
        assert n == 5 + len(seen_a.tokens.get(rid, []))
    assert b.store.load().requests == []


def test_restart_recovery_memory_store():
    store = MemoryStore()
    _check_recovery(*_crash_midway(store, store))


def test_restart_recovery_redis_store(redis_url, redis_prefix):
    store_a = open_store(redis_url, redis_prefix)
    store_b = open_store(redis_url, redis_prefix)               # a new process's own connection
    try:
        _check_recovery(*_crash_midway(store_a, store_b))
    finally:
        store_a.close()
        store_b.close()


# ---- tenants: caches keyed by id, dropped on the loop's thread -------------------------------------
def test_the_worker_gets_the_tenants_id_and_drops_a_removed_tenant_at_a_step_boundary():
    """The worker keys caches by `Request.tenant_id` (the name only without one); a removal
    (`drop_tenant`, from the gateway's thread) reaches the worker at the next step boundary, on
    the thread that steps, like every other worker call."""
    class Recording(FakeWorker):
        def drop_tenant(self, tenant):
            super().drop_tenant(tenant)
            self.drop_thread = threading.current_thread()

    worker = Recording()
    loop = make_loop(worker=worker)
    with_id = request("r1", tenant="acme")
    with_id.stats.tenant_id = "t-1"
    loop.submit(with_id)
    loop.submit(request("r2", tenant="offline"))
    run_to_end(loop)
    assert worker.tenants == {"r1": "t-1", "r2": "offline"}
    loop.drop_tenant("t-1")
    assert worker.dropped_tenants == []                  # queued, not applied off the loop
    stepper = threading.Thread(target=loop.step)
    stepper.start()
    stepper.join()
    assert worker.dropped_tenants == ["t-1"] and worker.drop_thread is stepper
