"""The clairvoyant lengths behind `srpt` on the real gateway (measurement only): the table's
semantics under token limits, its file round trip, the settings rule, and a srpt gateway that
serves a request the table says is short before one it says is long, whatever their order."""
from __future__ import annotations

import math
import threading
import time

import httpx
import pytest
from pydantic import ValidationError

from gateway.builders.embedded import build_embedded
from gateway.http.server import background_server
from gateway.settings import Settings
from scheduler.length_oracle import LengthOracle, prompt_key, true_remaining
from scheduler.request import RequestStats


def test_a_prompt_that_stopped_on_its_own_has_that_length_under_any_larger_limit():
    o = LengthOracle(cap=512, lengths={"a": 40, "b": 512})
    assert o.length("a", 512) == 40 and o.length("a", 2048) == 40
    assert o.length("a", 16) == 16                     # cut by a smaller limit
    assert o.length("b", 100) == 100                   # ran to the cap: any limit up to it is reached
    assert o.length("b", 1000) is None                 # beyond the cap: unknown
    assert o.length("missing", 100) is None


def test_the_table_round_trips_through_a_file(tmp_path):
    o = LengthOracle(cap=64, lengths={prompt_key(messages=[{"role": "user", "content": "hi"}]): 7})
    o.save(tmp_path / "o.json")
    assert LengthOracle.load(tmp_path / "o.json") == o


def test_prompt_keys_depend_on_the_content_only():
    m = [{"role": "user", "content": "hi"}]
    assert prompt_key(messages=m) == prompt_key(messages=[{"content": "hi", "role": "user"}])
    assert prompt_key(messages=m) != prompt_key(messages=[{"role": "user", "content": "hi!"}])
    assert prompt_key(prompt="hi") != prompt_key(messages=m)


def test_true_remaining_counts_down_and_unknown_goes_last():
    s = RequestStats("r", "t", 0.0, prompt_len=3, max_tokens=100, predicted_len=30)
    s.committed = 12
    assert true_remaining(s) == 18
    assert true_remaining(RequestStats("q", "t", 0.0, prompt_len=3, max_tokens=100)) == math.inf


def test_srpt_needs_a_table():
    with pytest.raises(ValidationError, match="length_oracle"):
        Settings(fake_worker=True, policy="srpt")


def test_a_srpt_gateway_serves_the_request_the_table_calls_short_first(tmp_path):
    """One request at a time; while a blocker runs, "long" arrives before "short". The fake
    worker runs both to their max_tokens (the same), so only the table can order them."""
    msgs = {name: [{"role": "user", "content": name}] for name in ("blocker", "long", "short")}
    table = LengthOracle(cap=64, lengths={prompt_key(messages=msgs["long"]): 60,
                                          prompt_key(messages=msgs["short"]): 3})
    table.save(tmp_path / "oracle.json")
    emb = build_embedded(Settings(fake_worker=True, fake_step_ms=5, max_batch=1,
                                  policy="srpt", length_oracle=tmp_path / "oracle.json"))
    emb.start()
    done: dict[str, float] = {}
    try:
        with background_server(emb.app) as url:
            def ask(name: str, max_tokens: int) -> None:
                r = httpx.post(url + "/v1/chat/completions", timeout=30,
                               headers={"Authorization": f"Bearer {emb.dev_key}"},
                               json={"model": "smollm2-135m", "messages": msgs[name],
                                     "max_tokens": max_tokens, "temperature": 0})
                assert r.status_code == 200, r.text
                done[name] = time.perf_counter()

            threads = [threading.Thread(target=ask, args=("blocker", 120))]
            threads[0].start()
            time.sleep(0.15)                                   # the blocker is running
            for name in ("long", "short"):
                threads.append(threading.Thread(target=ask, args=(name, 40)))
                threads[-1].start()
                time.sleep(0.05)
            for t in threads:
                t.join(30)
    finally:
        emb.stop()
    assert set(done) == {"blocker", "long", "short"}
    assert done["short"] < done["long"]
