"""Compiles that cannot stall anyone (workers/speculation/grammars.py, compile_pool.py): a compile
past its time limit is ended and its process replaced, identical compiles in flight run once, a
pinned grammar outlives the cache, and Ray mode's verifier replicas read the grammar the scheduler
shipped instead of compiling it. The real engine (xgrammar) and the default model's tokenizer."""
from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest

from workers.contract import SamplingParams, TreeBudget, WorkItem
from workers.model.loader import load_tokenizer
from workers.speculation.constraints import CompileTimeout
from workers.speculation.grammars import Grammars

VOCAB = 49152
LIMIT_S = 2.0


def obj(props: dict) -> dict:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def constraint(schema: dict) -> str:
    return json.dumps({"type": "json_schema", "schema": schema})


def small(tag: str) -> str:
    return constraint(obj({"city": {"enum": ["Paris", "Oslo"]}, tag: {"type": "string", "maxLength": 8}}))


# The kind of schema that takes seconds to compile and little to send: bounded repeats in a
# pattern, unrolled by the engine for every property they appear in.
SLOW = constraint(obj({f"p{i}": {"type": "array", "minItems": 50, "maxItems": 400, "items": {
    "type": "string", "pattern": "^[a-z]{10,100}-[0-9]{10,100}$"}} for i in range(24)}))


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(progress=False)


@pytest.fixture(scope="module")
def pooled(tokenizer):
    """Grammars compiling through a pool with a short time limit, warmed (its processes started)."""
    g = Grammars.from_tokenizer(tokenizer, VOCAB, [2])
    pool = g.use_pool(workers=2, timeout_s=LIMIT_S)
    g.compiled(small("warm"))
    yield g, pool
    pool.close()


def test_a_compile_past_the_limit_is_ended_and_its_process_replaced(pooled):
    g, pool = pooled
    kills = pool.kills
    t0 = time.monotonic()
    with pytest.raises(CompileTimeout):
        g.compiled(SLOW)
    assert time.monotonic() - t0 < LIMIT_S + 10            # the limit, not the compile's length
    assert pool.kills == kills + 1
    t0 = time.monotonic()
    g.compiled(small("after"))                              # the pool serves on
    assert time.monotonic() - t0 < LIMIT_S + 10
    with pytest.raises(CompileTimeout):                     # and nothing was kept of it
        g.compiled(SLOW)


def test_identical_compiles_in_flight_compile_once(pooled):
    g, pool = pooled
    c = constraint(obj({f"field_{i}": {"type": "string", "maxLength": 12} for i in range(60)}))
    before, ran = g.compiles, pool.compiles
    go = threading.Barrier(4)
    got: list[Any] = []

    def one() -> None:
        go.wait()
        got.append(g.compiled(c))
    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 4 and all(x is got[0] for x in got)
    assert g.compiles == before + 1 and pool.compiles == ran + 1


def test_descriptions_do_not_make_a_grammar_distinct(pooled):
    g, _ = pooled
    a = obj({"q": {"type": "string", "description": "one", "maxLength": 3}})
    b = obj({"q": {"type": "string", "description": "two", "maxLength": 3}})
    before = g.compiles
    assert g.compiled(constraint(a)) is g.compiled(constraint(b))
    assert g.compiles == before + 1


def test_a_pinned_grammar_outlives_the_cache(tokenizer):
    g = Grammars.from_tokenizer(tokenizer, VOCAB, [2], cache_size=2)
    held = g.pin(small("held"))
    for tag in ("a", "b", "c", "d"):                        # more than the cache keeps
        g.compiled(small(tag))
    compiles = g.compiles
    g.compiled(small("held"))                               # still here: no compile
    assert g.compiles == compiles
    held.release()
    for tag in ("e", "f"):
        g.compiled(small(tag))
    g.compiled(small("held"))                               # released, then evicted: compiled again
    assert g.compiles == compiles + 3


def test_a_dropped_pin_lets_go():
    import gc

    from gateway.text import ToyTokenizer

    tok = ToyTokenizer()
    g = Grammars.from_tokenizer(tok, len(tok), [tok.eos_token_id])
    pin = g.pin('{"type": "json_object"}')
    assert g.held() == 1
    del pin
    gc.collect()
    assert g.held() == 0


# ---- Ray mode: the verifier path reads what the scheduler compiled --------------------------------
class _Call:
    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


class OneReplica:
    """A deployment handle over one in-process worker, as Serve would route to one replica; its
    prefill does what `VerifierServer.prefill` does with a shipped grammar."""

    def __init__(self, worker, grammars):
        self.worker, self.grammars = worker, grammars
        self.prefill, self.step, self.release = self._M(self, "prefill"), self._M(self, "step"), self._M(self, "release")

    class _M:
        def __init__(self, handle, name):
            self.handle, self.name = handle, name

        def remote(self, *args, replica=None, loads=None, assigned=None, avoid=(), free=None, prefer=None,
                   release=(), grammar=None, **kw):
            from gateway.ray_serve.deployments import take_grammar
            from gateway.ray_serve.releases import apply_releases

            w = self.handle.worker
            apply_releases(w, release.get("r0", ()) if isinstance(release, dict) else release)
            if self.name == "prefill":
                take_grammar(self.handle.grammars, kw["sampling"], grammar)
                done = w.prefill(*args, **kw)
                return _Call({"replica": "r0", "busy_s": 0.0, "cached": done.cached, "features": None,
                              "kv_tokens": done.kv_tokens, "kv": w.kv_slots()})
            if self.name == "step":
                return _Call({"results": w.step(args[0]), "missing": [], "busy_s": 0.0})
            apply_releases(w, args[0])
            return _Call(None)


def test_the_verifier_path_never_compiles_what_the_scheduler_compiled(tmp_path, tokenizer):
    from gateway.ray_serve.verifier_pool import VerifierPool
    from tests.helpers import tiny_model_dir
    from workers.runtime import load_runtime
    from workers.batch_worker import BatchWorker

    rt = load_runtime(str(tiny_model_dir(tmp_path)), progress=False)
    worker = BatchWorker(rt.verifier(max_tree_tokens=16), default_drafter="none", grammar=rt.grammar_drafter(),
                         grammars=rt.grammars)
    scheduler = Grammars.from_tokenizer(tokenizer, rt.forward.vocab_size, sorted(rt.stop_token_ids), ships=True)
    pool = VerifierPool(OneReplica(worker, rt.grammars), context_limit=worker.context_limit, grammars=scheduler)
    c = constraint(obj({"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}}))
    scheduler.pin(c)                                       # what the gateway's check does
    prompt = tokenizer("JSON please", add_special_tokens=False)["input_ids"]
    sampling = SamplingParams(constraint=c)
    for rid in ("a", "b"):
        pool.prefill(rid, prompt, prompt_len=len(prompt), sampling=sampling, max_new_tokens=40)
    for _ in range(3):
        pool.step([WorkItem(rid, TreeBudget(8, 8)) for rid in ("a", "b")])
    pool.evict("a")                                        # and a re-prefill ships it again
    pool.prefill("a", prompt, prompt_len=len(prompt), sampling=sampling, max_new_tokens=40)
    pool.step([WorkItem("a", TreeBudget(8, 8))])
    assert scheduler.compiles == 1
    assert rt.grammars.compiles == 0, "a verifier replica compiled a grammar it was sent"
