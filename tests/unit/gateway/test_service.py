"""GenerationService over a real step loop and the fake worker (no HTTP): text and stop strings,
cancellation freeing KV, the tenant's speculation policy, limits, queues, and field checks."""
from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from gateway.errors import ApiError
from gateway.tenancy.limits import Limiter
from workers.fake_worker import PacedFakeWorker
from gateway.service import GenerateInput, GenerateOutput, GenerationService, StreamChunk
from gateway.tenancy.records import SpeculationPolicy, Tenant
from gateway.text import ToyTokenizer
from scheduler.admission import AdmissionControl, AdmissionLimits
from workers.fake_worker import token_at
from scheduler.loop import StepLoop
from scheduler.policies import make_policy

TOK = ToyTokenizer()
MODEL = "toy"


def truth_text(rid: str, n: int) -> str:
    return TOK.decode([token_at(rid, p) for p in range(n)], skip_special_tokens=True)


class Rig:
    """A started step loop over a (paced) fake worker, and a service over it."""

    def __init__(self, *, step_s: float = 0.0, context: int = 256, limiter=None, max_batch: int = 4,
                 admission: AdmissionLimits | None = None, alpha: float = 0.6, tokenizer=TOK):
        self.worker = PacedFakeWorker(step_s, alpha=alpha, context_limit=context)
        self.calls = []
        real_step = self.worker.step

        def spy(items):
            self.calls.extend(items)
            return real_step(items)

        self.worker.step = spy
        policy = make_policy("fcfs", max_batch=max_batch, token_budget=64, aging_bound_s=None)
        self.loop = StepLoop(policy, self.worker, admission=AdmissionControl(admission or AdmissionLimits()),
                             max_resident=max(8, max_batch))
        counter = itertools.count()
        self.service = GenerationService(self.loop, tokenizer, models=[MODEL], limiter=limiter,
                                         drafters=("ngram",),
                                         request_id=lambda kind: f"{kind}-{next(counter)}")
        self.loop.start()

    def close(self):
        self.loop.stop()

    def wait_gone(self, rid: str, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while rid in self.worker.resident() or rid in self.loop.state.requests:
            assert time.monotonic() < deadline, f"{rid} still live"
            time.sleep(0.005)


@pytest.fixture
def rig():
    r = Rig()
    yield r
    r.close()


def inp(tenant=None, **kw) -> GenerateInput:
    kw.setdefault("prompt", "Hello there")
    kw.setdefault("max_tokens", 12)
    return GenerateInput(tenant=tenant or Tenant("t"), model=kw.pop("model", MODEL), **kw)


async def arrive_and_generate(service, i: GenerateInput) -> GenerateOutput:
    """What a front does with a request: its arrival charged to its tenant's rpm, then the rest."""
    await service.arrive(i.tenant)
    return await service.generate(i)


async def collect(service, i: GenerateInput):
    chunks, out = [], None
    stream = service.stream(i)
    async for item in stream:
        if isinstance(item, StreamChunk):
            chunks.append(item)
        else:
            out = item
    return chunks, out


def test_generate_returns_the_workers_tokens_as_text_with_usage_and_stats(rig):
    out = asyncio.run(rig.service.generate(inp(max_tokens=20)))
    assert out.request_id == "cmpl-0"
    assert out.token_ids == tuple(token_at("cmpl-0", p) for p in range(20))
    assert out.text == truth_text("cmpl-0", 20)
    assert (out.finish_reason, out.prompt_tokens, out.completion_tokens) == ("length", 11, 20)
    s = out.speculation
    assert s.steps >= 1 and 0 <= s.accepted <= s.drafted and s.tau == pytest.approx(20 / s.steps)


def test_stream_chunks_add_up_to_the_output(rig):
    chunks, out = asyncio.run(collect(rig.service, inp(max_tokens=30)))
    assert "".join(c.text for c in chunks) == out.text
    assert sum((c.token_ids for c in chunks), ()) == out.token_ids
    assert isinstance(out, GenerateOutput)


@pytest.mark.parametrize("start,length", [(0, 3), (4, 9), (7, 12)])
def test_a_stop_string_is_never_emitted_and_ends_the_request(rig, start, length):
    # The fake worker's text for the next request id is known: pick a stop string that spans
    # token boundaries and see it cut, streamed or not.
    full = truth_text("cmpl-0", 40)
    stop = full[start:start + length]
    assert len(stop) == length
    chunks, out = asyncio.run(collect(rig.service, inp(max_tokens=40, stop=(stop, "never-there"))))
    assert out.finish_reason == "stop"
    assert out.text == full[:full.find(stop)]
    assert "".join(c.text for c in chunks) == out.text
    assert out.completion_tokens < 40
    rig.wait_gone("cmpl-0")


def test_closing_a_stream_cancels_the_request_and_frees_its_kv():
    rig = Rig(step_s=0.01, context=100_000)
    try:
        async def go():
            stream = rig.service.stream(inp(max_tokens=50_000))
            first = await stream.__anext__()
            assert isinstance(first, StreamChunk)
            assert stream.request_id in rig.worker.resident()
            await stream.aclose()
            return stream.request_id

        rid = asyncio.run(go())
        rig.wait_gone(rid)
        assert rig.loop.store.get(rid).stats.status.value == "cancelled"
    finally:
        rig.close()


def test_tenant_speculation_policy_bounds_the_request():
    rig = Rig(alpha=0.9)
    try:
        off = Tenant("off", speculation=SpeculationPolicy(enabled=False))
        capped = Tenant("capped", speculation=SpeculationPolicy(max_tree_tokens=2))
        asyncio.run(rig.service.generate(inp(off, max_tokens=20, speculation=True)))
        asyncio.run(rig.service.generate(inp(capped, max_tokens=20, max_tree_tokens=50)))
        asyncio.run(rig.service.generate(inp(Tenant("t"), max_tokens=20, speculation=False)))
        asyncio.run(rig.service.generate(inp(Tenant("t"), max_tokens=20, max_tree_tokens=1)))
        by_id = {}
        for item in rig.calls:
            by_id.setdefault(item.request_id, []).append(item.budget)
        assert all(not b.speculates for b in by_id["cmpl-0"])           # tenant: off
        assert all(b.max_nodes <= 2 for b in by_id["cmpl-1"])           # tenant cap wins
        assert all(not b.speculates for b in by_id["cmpl-2"])           # request: off
        assert all(b.max_nodes <= 1 for b in by_id["cmpl-3"])           # request cap wins
        assert rig.loop.policy.fairness.weights["t"] == 1.0
    finally:
        rig.close()


def test_tenant_priority_and_weight_reach_the_scheduler(rig):
    t = Tenant("gold", weight=3.0, priority=1, max_queued=7)
    out = asyncio.run(rig.service.generate(inp(t)))
    assert rig.loop.store.get(out.request_id).stats.priority == 1
    assert rig.loop.policy.fairness.weights["gold"] == 3.0
    assert rig.loop.admission.limits.per_tenant["gold"] == 7


def test_chat_messages_go_through_the_chat_template(rig):
    msgs = [{"role": "user", "content": "hi"}]
    out = asyncio.run(rig.service.generate(inp(prompt=None, messages=msgs, max_tokens=3)))
    assert out.request_id.startswith("chatcmpl-")
    assert out.prompt_tokens == len(TOK.apply_chat_template(msgs))


@pytest.mark.parametrize("fields,status,param", [
    ({"model": "other"}, 404, "model"),
    ({"temperature": 3.0}, 400, "temperature"),
    ({"temperature": float("nan")}, 400, "temperature"),
    ({"top_p": 0.0}, 400, "top_p"),
    ({"top_k": -2}, 400, "top_k"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"seed": 2**70}, 400, "seed"),
    ({"stop": ("x",) * 17}, 400, "stop"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": None}, 400, "prompt"),
    ({"messages": [{"role": "user", "content": "x"}]}, 400, "messages"),
    ({"prompt": None, "messages": []}, 400, "messages"),
    ({"prompt": None, "prompt_ids": (5, 1000)}, 400, "prompt.1"),
    ({"prompt": "x" * 300}, 413, "prompt"),
    ({"max_tree_tokens": -1}, 400, "speculation.max_tree_tokens"),
])
def test_invalid_inputs_are_refused_naming_the_field(rig, fields, status, param):
    with pytest.raises(ApiError) as e:
        asyncio.run(collect(rig.service, inp(**fields)))
    assert (e.value.status, e.value.param) == (status, param)
    assert not rig.loop.state.requests


def test_a_model_the_tenant_may_not_use_is_403(rig):
    with pytest.raises(ApiError) as e:
        asyncio.run(rig.service.generate(inp(Tenant("t", models=("llama-*",)))))
    assert (e.value.status, e.value.code) == (403, "model_not_allowed")


def test_max_tokens_beyond_the_context_is_refused_and_none_gets_the_rest():
    """OpenAI's 400 `context_length_exceeded` when prompt + max_tokens passes the context (it
    was clamped silently); exactly filling it is allowed; without max_tokens a request gets the
    rest of the context."""
    rig = Rig(context=40)
    try:
        with pytest.raises(ApiError) as e:
            asyncio.run(rig.service.generate(inp(prompt="x" * 30, max_tokens=11)))
        assert (e.value.status, e.value.code, e.value.param) == (400, "context_length_exceeded",
                                                                 "max_tokens")
        assert "at most 10" in e.value.message
        out = asyncio.run(rig.service.generate(inp(prompt="x" * 30, max_tokens=10)))
        assert (out.completion_tokens, out.finish_reason) == (10, "length")
        out = asyncio.run(rig.service.generate(inp(prompt="x" * 30, max_tokens=None)))
        assert out.completion_tokens == 10
    finally:
        rig.close()


def test_rate_limits_refuse_with_429_and_retry_after_and_release_their_tokens():
    limiter = Limiter()
    rig = Rig(limiter=limiter)
    try:
        t = Tenant("t", rpm=2, tpm=1000)
        asyncio.run(arrive_and_generate(rig.service, inp(t)))
        asyncio.run(arrive_and_generate(rig.service, inp(t)))
        with pytest.raises(ApiError) as e:
            asyncio.run(arrive_and_generate(rig.service, inp(t)))
        assert (e.value.status, e.value.code) == (429, "rpm_exceeded")
        assert e.value.retry_after_s > 0 and "Retry-After" in e.value.headers()
        # tokens reserved (prompt + max_tokens) are corrected to what was used
        # (ids: cmpl-0, 1 served; the third, refused before any work, got none). Each request reserves 11 + 150 tokens; a stop
        # string at the start ends it after ~12 tokens used. Without the refund the second would
        # be refused (2 × 161 > 200); with it, three fit (the next needs 161 tokens of headroom).
        big = Tenant("big", tpm=200)
        for i in range(2, 5):
            out = asyncio.run(rig.service.generate(
                inp(big, max_tokens=150, stop=(truth_text(f"cmpl-{i}", 2),))))
            assert out.finish_reason == "stop" and out.text == ""
    finally:
        rig.close()


def test_full_queues_refuse_429_for_the_tenant_and_503_for_everyone():
    rig = Rig(step_s=0.01, context=100_000,
              admission=AdmissionLimits(max_live=3, max_live_per_tenant=2))
    try:
        async def go():
            a1 = rig.service.stream(inp(Tenant("a"), max_tokens=10_000))
            a2 = rig.service.stream(inp(Tenant("a"), max_tokens=10_000))
            with pytest.raises(ApiError) as e:
                rig.service.stream(inp(Tenant("a")))
            assert (e.value.status, e.value.code) == (429, "tenant_queue_full")
            assert e.value.retry_after_s is not None
            b1 = rig.service.stream(inp(Tenant("b"), max_tokens=10_000))
            with pytest.raises(ApiError) as e:
                rig.service.stream(inp(Tenant("c")))
            assert (e.value.status, e.value.code) == (503, "queue_full")
            assert e.value.retry_after_s is not None
            for s in (a1, a2, b1):
                await s.aclose()
            return [s.request_id for s in (a1, a2, b1)]

        for rid in asyncio.run(go()):
            rig.wait_gone(rid)
    finally:
        rig.close()


def test_ready_reflects_every_check(rig):
    assert rig.service.ready()
    svc = GenerationService(rig.loop, TOK, models=[MODEL], ready_checks=[lambda: True, lambda: 1 / 0])
    assert not svc.ready()


# ---- the front: limits before work, tokenization off the event loop -----------------------------
class CountingTokenizer(ToyTokenizer):
    """The toy tokenizer, counting its calls; `gate` (when set) holds each call until released."""

    def __init__(self, gate=None) -> None:
        super().__init__()
        self.calls, self.gate = 0, gate

    def __call__(self, text, add_special_tokens=True):
        self.calls += 1
        if self.gate is not None:
            assert self.gate.wait(10)
        return super().__call__(text, add_special_tokens)


def _front_rig(tok, *, context: int = 256, limiter=None) -> Rig:
    return Rig(context=context, limiter=limiter, tokenizer=tok)


def test_an_over_rpm_tenant_gets_429_as_it_arrives_before_any_work():
    tok = CountingTokenizer()
    rig = _front_rig(tok, context=1024, limiter=Limiter(None))
    t = Tenant("t", rpm=1)
    try:
        asyncio.run(arrive_and_generate(rig.service, inp(t, max_tokens=4)))
        assert tok.calls == 1
        with pytest.raises(ApiError) as err:             # oversized as well: 429, not 413
            asyncio.run(arrive_and_generate(rig.service, inp(t, prompt="x" * 5000, max_tokens=4)))
        assert err.value.status == 429 and err.value.code == "rpm_exceeded"
        assert tok.calls == 1                              # refused before any tokenizing
    finally:
        rig.close()


def test_a_prompt_too_long_for_any_tokenization_gets_413_untokenized():
    """More characters than the context could hold at `max_token_chars` each (1 for the toy
    tokenizer); a tenant's max_prompt_tokens bounds the same way, then exactly."""
    tok = CountingTokenizer()
    rig = _front_rig(tok, context=256)
    try:
        with pytest.raises(ApiError) as err:
            asyncio.run(rig.service.generate(inp(prompt="x" * 300)))
        assert err.value.status == 413 and err.value.code == "context_length_exceeded"
        with pytest.raises(ApiError) as err:
            asyncio.run(rig.service.generate(inp(messages=[{"role": "user", "content": "x" * 300}],
                                                 prompt=None)))
        assert err.value.status == 413 and err.value.param == "messages"
        capped = Tenant("capped", max_prompt_tokens=50)
        with pytest.raises(ApiError) as err:
            asyncio.run(rig.service.generate(inp(capped, prompt="x" * 51)))
        assert err.value.status == 413 and err.value.code == "max_prompt_tokens_exceeded"
        assert tok.calls == 0
        with pytest.raises(ApiError) as err:              # 45 characters, more tokens (template)
            asyncio.run(rig.service.generate(inp(capped, messages=[{"role": "user", "content": "y" * 45}],
                                                 prompt=None)))
        assert err.value.status == 413 and err.value.code == "max_prompt_tokens_exceeded"
        assert tok.calls == 1                              # this one was counted exactly
        out = asyncio.run(rig.service.generate(inp(capped, prompt="x" * 50, max_tokens=3)))
        assert out.completion_tokens == 3
    finally:
        rig.close()


def test_tokenizing_any_prompt_runs_off_the_event_loop():
    """While a prompt's tokenization is held, the event loop still runs other work: open_stream
    prepares every request in a worker thread, the shortest too."""
    import threading

    gate = threading.Event()
    tok = CountingTokenizer(gate)
    rig = _front_rig(tok, context=1024)
    try:
        async def go():
            held = asyncio.ensure_future(rig.service.generate(inp(prompt="hi", max_tokens=4)))
            while tok.calls == 0:
                await asyncio.sleep(0.005)
            ticks = 0
            for _ in range(20):                            # the loop is free: it ticks
                await asyncio.sleep(0.001)
                ticks += 1
            assert not held.done()
            gate.set()
            return ticks, await held

        ticks, out = asyncio.run(go())
        assert ticks == 20 and out.completion_tokens == 4
    finally:
        rig.close()


def test_with_limits_in_redis_a_request_is_charged_as_it_arrives(redis_url, redis_prefix):
    """The limiter's calls may wait on the network: never on the event loop."""
    rig = Rig(limiter=Limiter(redis_url, redis_prefix))
    try:
        t = Tenant("t", rpm=1)
        out = asyncio.run(arrive_and_generate(rig.service, inp(t, max_tokens=3)))
        assert out.completion_tokens == 3
        with pytest.raises(ApiError) as err:
            asyncio.run(rig.service.arrive(t))
        assert err.value.code == "rpm_exceeded"
    finally:
        rig.close()
