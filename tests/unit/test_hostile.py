"""`specgate loadtest hostile`: the report's arithmetic and verdicts on hand-made records, what
each pattern's request builder claims about its requests, and a short run of two patterns
against `specgate serve` on the fake worker."""
from __future__ import annotations

import argparse
import json

import pytest

from loadtest.hostile import bodies
from loadtest.hostile.records import (MemorySample, Outcome, Probe, VictimSample, error_code,
                                      event_error, grpc_outcome, sse_data)
from loadtest.hostile.report import (TARGETS, attacker_summary, Phase, Targets, build_report, counts, ratio, spread,
                                     summary)
from loadtest.hostile.target import (Quotas, lag_between, live_requests, loop_lag, metric_samples,
                                     tenants_file)


# ---- arithmetic ----------------------------------------------------------------------------------
def test_spread_is_nearest_rank_and_ratio_guards_its_base():
    xs = [float(i) for i in range(1, 101)]
    assert spread(xs) == {"p50": 50.0, "p99": 99.0, "max": 100.0}
    assert spread([]) == {"p50": None, "p99": None, "max": None}
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(None, 2.0) is None and ratio(1.0, None) is None and ratio(1.0, 0.0) is None
    assert counts([200, 429, 200, "cut"]) == {"200": 2, "429": 1, "cut": 1}


def _victim(t: float, ttft: float, gaps=(0.02, 0.02), **kw) -> VictimSample:
    fields = dict(status=200, done=True, finish_reason="length", completion_tokens=8)
    fields.update(kw)
    return VictimSample(t, 8, started=t, ended=t + 1, ttft=ttft, gaps=list(gaps), **fields)


@pytest.mark.parametrize("kw, complete", [
    ({}, True),
    ({"finish_reason": "stop", "completion_tokens": 3}, True),      # ended early, by itself
    ({"completion_tokens": 5}, False),                              # tokens missing at "length"
    ({"done": False}, False),                                       # no [DONE]
    ({"code": "internal_error"}, False),                            # an error event in the 200
    ({"status": 429}, False),
    ({"finish_reason": None}, False),
    ({"completion_tokens": None}, False),                           # no usage
])
def test_a_victim_request_is_complete_only_when_nothing_is_missing(kw, complete):
    assert _victim(0.0, 0.1, **kw).complete is complete


def _run(attack_ttft: float, attack_gap: float, *, probes=(0.01,), outcomes=(), lost=0,
         redis_peak=None, watermark=None) -> dict:
    """A baseline window [0, 10) and one attack window [10, 20): victim requests each second."""
    victim = [_victim(float(t), 0.1, gaps=(0.02, 0.04)) for t in range(10)]
    victim += [_victim(float(t), attack_ttft, gaps=(attack_gap,)) for t in range(10, 20)]
    for s in victim[10:10 + lost]:
        s.done = False
    probe_list = [Probe(float(t) + 0.5, 0.005) for t in range(10)]
    probe_list += [Probe(10.0 + i * 0.1, lat) for i, lat in enumerate(probes)]
    memory = [MemorySample(5.0, 100, 1000), MemorySample(15.0, redis_peak, 2000)]
    phases = [Phase("baseline", 0.0, 10.0, 10.0, attack=False),
              Phase("tools", 10.0, 20.0, 21.0, tuple(outcomes), ("a note",))]
    return build_report(phases, victim, probe_list, memory,
                        Targets(redis_watermark_bytes=watermark), {"window_s": 10})


def test_ratios_are_against_the_baseline_of_the_same_run():
    rep = _run(0.15, 0.06)
    base, tools = rep["phases"]["baseline"], rep["phases"]["tools"]
    assert base["victim"]["ttft_s"]["p99"] == 0.1 and base["victim"]["tbt_s"]["p99"] == 0.04
    assert "targets" not in base and rep["verdicts"] == {"tools": "PASS"}
    assert tools["ratios"]["ttft_p99"] == pytest.approx(1.5)          # exactly the limit: PASS
    assert tools["ratios"]["tbt_p99"] == pytest.approx(1.5)
    assert tools["ratios"]["tbt_p50"] == pytest.approx(3.0)           # 0.06 over 0.02
    assert set(tools["targets"]) == set(TARGETS)
    assert tools["targets"]["redis_watermark"] == "n/a"               # memory mode
    assert tools["memory"]["rss_bytes"] == {"start": 1000, "peak": 2000}
    assert tools["drain_s"] == 1.0 and tools["notes"] == ["a note"]
    assert rep["victim_overall"]["lost"] == 0


@pytest.mark.parametrize("run_kw, failed", [
    ({"attack_ttft": 0.16, "attack_gap": 0.02}, {"victim_ttft_p99"}),
    ({"attack_ttft": 0.1, "attack_gap": 0.07}, {"victim_tbt_p99"}),
    ({"attack_ttft": 0.1, "attack_gap": 0.02, "probes": (0.01, 0.2)}, {"health"}),
    ({"attack_ttft": 0.1, "attack_gap": 0.02, "probes": (0.01, None)}, {"health"}),
    ({"attack_ttft": 0.1, "attack_gap": 0.02, "lost": 1}, {"nothing_lost"}),
    ({"attack_ttft": 0.1, "attack_gap": 0.02,
      "outcomes": (Outcome("tools", 10, 11, 500, "internal_error"),)}, {"no_5xx"}),
    ({"attack_ttft": 0.1, "attack_gap": 0.02,
      "outcomes": (Outcome("tools", 10, 11, 429, "rpm_exceeded"),
                   Outcome("tools", 10, 11, 413, None, detail="x"))}, {"refusals_named"}),
    ({"attack_ttft": 0.1, "attack_gap": 0.02, "redis_peak": 300, "watermark": 200},
     {"redis_watermark"}),
    ({"attack_ttft": 0.1, "attack_gap": 0.02, "redis_peak": 200, "watermark": 200}, set()),
])
def test_each_target_fails_on_its_own(run_kw, failed):
    rep = _run(**run_kw)
    tools = rep["phases"]["tools"]
    assert {t for t, v in tools["targets"].items() if v == "FAIL"} == failed
    assert tools["verdict"] == ("FAIL" if failed else "PASS")
    if failed:
        assert f"tools: FAIL {', '.join(t for t in TARGETS if t in failed)}" in summary(rep)


def test_a_victim_without_one_complete_request_fails_latency_and_counts_cut_apart():
    rep = _run(0.1, 0.02, lost=10, outcomes=(Outcome("stored", 10, 20, 0, cut=True),
                                             Outcome("stored", 10, 11, 200)))
    tools = rep["phases"]["tools"]
    assert tools["targets"]["victim_ttft_p99"] == "FAIL" and tools["ratios"]["ttft_p99"] is None
    assert tools["attacker"]["statuses"] == {"200": 1, "cut": 1}
    assert tools["attacker"]["unanswered"] == 0


def test_a_skipped_pattern_is_judged_on_nothing():
    victim = [_victim(float(t), 0.1 if t < 10 else 9.0) for t in range(20)]
    phases = [Phase("baseline", 0.0, 10.0, 10.0, attack=False),
              Phase("bytes", 10.0, 20.0, 20.0, notes=("skipped: no byte token",), skipped=True)]
    rep = build_report(phases, victim, [], [], Targets(), {})
    assert rep["verdicts"] == {"bytes": "SKIPPED"} and "targets" not in rep["phases"]["bytes"]


def test_the_busy_reference_is_judged_on_nothing_and_each_attack_is_also_held_to_it():
    # baseline [0, 10): ttft 0.1; busy [10, 20): 0.3, an ordinary full batch; tools [20, 30): 0.6
    victim = [_victim(float(t), 0.1 if t < 10 else 0.3 if t < 20 else 0.6, gaps=(0.04,))
              for t in range(30)]
    phases = [Phase("baseline", 0.0, 10.0, 10.0, attack=False),
              Phase("busy", 10.0, 20.0, 20.0), Phase("tools", 20.0, 30.0, 30.0)]
    rep = build_report(phases, victim, [], [], Targets(), {})
    assert rep["verdicts"] == {"busy": "REFERENCE", "tools": "FAIL"}
    assert "targets" not in rep["phases"]["busy"] and "ratios_to_busy" not in rep["phases"]["busy"]
    tools = rep["phases"]["tools"]
    assert tools["ratios"]["ttft_p99"] == pytest.approx(6.0)
    assert tools["ratios_to_busy"] == {"ttft_p99": pytest.approx(2.0), "tbt_p99": pytest.approx(1.0)}
    assert "tools: beside a busy neighbour's p99s (ttft, tbt) (2.00x) (1.00x)" in summary(rep)
    from tools.bench_tables import hostile
    row = next(line for line in hostile(rep) if line.startswith("| tools |"))
    assert "2.00× / 1.00×" in row


def test_the_busy_pattern_is_an_ordinary_streamed_chat():
    body = json.loads(bodies.busy_stream("m", 64).with_nonce(5))
    assert body["stream"] and body["max_tokens"] == 64 and "(5)" in body["messages"][0]["content"]
    assert set(body) == {"model", "messages", "max_tokens", "temperature", "stream"}


def test_the_benchmarks_page_table_shows_each_phase_and_its_failed_targets():
    from tools.bench_tables import hostile

    rep = _run(0.3, 0.02, outcomes=(Outcome("tools", 10, 11, 429, "rpm_exceeded"),))
    lines = hostile(rep)
    tools = next(line for line in lines if line.startswith("| tools |"))
    assert "300.0 (3.00×)" in tools and "429: 1" in tools and "rpm_exceeded" in tools
    assert tools.endswith("FAIL victim_ttft_p99 |")
    assert next(line for line in lines if line.startswith("| baseline |")).endswith("quiet |")


# ---- what the gateway answered -------------------------------------------------------------------
def test_error_codes_from_bodies_events_and_grpc():
    assert error_code(b'{"error": {"code": "rpm_exceeded", "type": "rate_limit_error"}}') == "rpm_exceeded"
    assert error_code(b"<html>") == "unknown"
    assert event_error({"error": {"type": "server_error", "code": None}}) == ("server_error", True)
    assert event_error({"type": "error", "code": "generation_failed"}) == ("generation_failed", True)
    assert event_error({"type": "error", "code": "invalid_value"}) == ("invalid_value", False)
    assert event_error({"choices": []}) is None and event_error(None) is None
    assert sse_data('data: {"a": 1}') == {"a": 1}
    assert sse_data("data: [DONE]") is None and sse_data("id: 3") is None
    o = Outcome("grpc", 0.0)
    grpc_outcome(o, "RESOURCE_EXHAUSTED", {"error-code": "rpm_exceeded"}, "slow down")
    assert (o.status, o.code, o.detail, o.server_error) == (429, "rpm_exceeded", None, False)
    o = Outcome("grpc", 0.0)
    grpc_outcome(o, "RESOURCE_EXHAUSTED", {}, "Received message larger than max (4718613 vs. 2097152)")
    assert (o.status, o.code, o.detail) == (429, "max_receive_message_length", None)
    o = Outcome("grpc", 0.0)
    grpc_outcome(o, "RESOURCE_EXHAUSTED", {}, "Received message larger than max")  # no cap stated
    assert o.code is None and o.detail.startswith("grpc RESOURCE_EXHAUSTED: Received")
    o = Outcome("grpc", 0.0)
    grpc_outcome(o, "UNAVAILABLE", {}, "Received message larger than max (5 vs. 4)")
    assert o.code is None
    o = Outcome("grpc", 0.0)
    grpc_outcome(o, "INTERNAL", {}, "")
    assert o.status == 500 and o.server_error


def test_metrics_give_live_requests_and_loop_lag_only_where_there_is_one():
    text = ("# TYPE specgate_queue_depth gauge\n"
            'specgate_queue_depth{level="0",status="queued"} 2.0\n'
            'specgate_queue_depth{level="0",status="running"} 3.0\n'
            "# TYPE specgate_steps counter\nspecgate_steps_total 7.0\n")
    samples = metric_samples(text)
    assert live_requests(samples) == 5.0 and loop_lag(samples) is None
    assert live_requests(metric_samples("# TYPE x gauge\nx 1.0\n")) is None


def _lag_page(buckets: dict[str, float], total: float) -> dict[str, float]:
    lines = ["# TYPE specgate_event_loop_lag_seconds histogram"]
    lines += [f'specgate_event_loop_lag_seconds_bucket{{le="{le}"}} {n}' for le, n in buckets.items()]
    lines += [f"specgate_event_loop_lag_seconds_count {buckets['+Inf']}",
              f"specgate_event_loop_lag_seconds_sum {total}"]
    return loop_lag(metric_samples("\n".join(lines) + "\n"))


def test_the_loop_lag_of_a_phase_is_the_difference_of_two_readings_of_the_histogram():
    before = _lag_page({"0.01": 10, "0.1": 10, "1.0": 10, "+Inf": 10}, 0.02)
    after = _lag_page({"0.01": 105, "0.1": 109, "1.0": 110, "+Inf": 110}, 0.02 + 0.9)
    assert lag_between(before, after) == pytest.approx(
        {"wakeups": 100, "mean_s": 0.009, "p99_le_s": 0.1, "max_le_s": 1.0})
    beyond = _lag_page({"0.01": 105, "0.1": 109, "1.0": 109, "+Inf": 110}, 30.0)
    assert lag_between(before, beyond)["max_le_s"] is None      # past the largest bound
    assert lag_between(None, after) is None and lag_between(after, after) is None


def test_the_tenants_file_is_one_the_gateway_reads(tmp_path):
    from gateway.tenancy.config import load_tenants_file

    keys = {"victim": "sk-victim-0123456789abcdef", "attacker": "sk-attacker-0123456789abcdef"}
    path = tenants_file(tmp_path / "t.yaml", keys, "sk-admin-0123456789abcdef",
                        Quotas(rpm=1000, tpm=None, max_concurrent=64))
    tenants, admin = load_tenants_file(path)
    assert [(t.name, t.rpm, t.tpm, t.max_concurrent) for t, _ in tenants] == [
        ("victim", 1000, None, 64), ("attacker", 1000, None, 64)]
    assert len(admin) == 1


# ---- the request builders ------------------------------------------------------------------------
def test_the_tools_bomb_is_between_1_5_and_2_mib_and_valid_json():
    spliced = bodies.tools_bomb("m")
    raw = spliced.with_nonce(12345)
    assert 1.5 * bodies.MIB < len(raw) < 2 * bodies.MIB
    body = json.loads(raw)
    assert len(body["tools"]) == 28 and body["messages"][0]["content"] == "Look up entry 12345."
    assert {len(t["function"]["description"]) for t in body["tools"]} == {60_000}
    assert len({t["function"]["name"] for t in body["tools"]}) == 28
    assert spliced.with_nonce(1) != spliced.with_nonce(2)


def test_the_schema_bomb_has_twelve_arrays_of_50_to_400_items_and_differs_only_in_its_description():
    body = bodies.schema_bomb("m")
    a, b = json.loads(body.with_nonce(1)), json.loads(body.with_nonce(2))
    schema = a["response_format"]["json_schema"]["schema"]
    arrays = list(schema["properties"].values())
    assert len(arrays) == 12
    assert min(p["minItems"] for p in arrays) == 50 and max(p["maxItems"] for p in arrays) == 400
    assert all(p["items"]["pattern"] == bodies.ITEM_PATTERN and "{" in p["items"]["pattern"]
               for p in arrays)
    other = b["response_format"]["json_schema"]["schema"]
    assert schema["description"] != other["description"]
    assert {**schema, "description": ""} == {**other, "description": ""}


def test_the_byte_token_decodes_alone_to_the_replacement_character():
    from gateway.text import ToyTokenizer
    from workers.model.loader import load_tokenizer, resolve_model

    tok = load_tokenizer(str(resolve_model(progress=False)), progress=False)
    ids = bodies.byte_token_ids(tok, limit=3)
    assert len(ids) == 3 and all(tok.decode([i]) == "\ufffd" for i in ids)
    assert bodies.byte_token_ids(ToyTokenizer()) == []          # no byte-level tokens
    body = json.loads(bodies.byte_stream("m", ids[0], 2000).with_nonce(1))
    assert body["logit_bias"] == {str(ids[0]): 100} and body["max_tokens"] == 2000
    assert body["stream"] and body["stream_options"]["resumable"]


def test_the_other_builders():
    stored = json.loads(bodies.stored_response("m").with_nonce(3))
    assert stored["store"] and stored["background"] and stored["input"] == "Note 3: ok."
    sizes = bodies.GRPC_PROMPT_BYTES
    assert sizes[0] < 2 * bodies.MIB < sizes[1] < sizes[2] < 4 * bodies.MIB < sizes[3]
    assert all(len(bodies.grpc_prompt(n, 7).encode()) == n for n in sizes)
    raw = bodies.idle_stream("m", "127.0.0.1:80", "sk-x", 100, 4)
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"POST /v1/chat/completions HTTP/1.1")
    assert f"Content-Length: {len(body)}".encode() in head and json.loads(body)["stream"]
    with pytest.raises(ValueError):
        bodies.Spliced.of({"a": "no marker"})


# ---- a short run ---------------------------------------------------------------------------------
def _args(argv: list[str]) -> argparse.Namespace:
    from loadtest.hostile import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(argv)


def test_unknown_patterns_are_refused():
    from loadtest.hostile import run

    with pytest.raises(ValueError, match="unknown nope"):
        run(_args(["--patterns", "stored,nope"]))


def test_a_short_run_on_the_fake_worker(tmp_path):
    """Two patterns of 2 s against `specgate serve` on the fake worker: the report has every
    phase, verdicts for the attacks, the victim's requests all whole, the attacker's requests."""
    from loadtest.hostile import run

    out = tmp_path / "hostile.json"
    assert run(_args(["--fake-step-ms", "5", "--patterns", "stored,grpc", "--window-s", "2",
                      "--json", str(out)])) == 0
    rep = json.loads(out.read_text())
    assert rep["meta"]["commit"] is not None
    assert list(rep["phases"]) == ["baseline", "stored", "grpc", "after"]
    assert set(rep["verdicts"]) == {"stored", "grpc"}
    base = rep["phases"]["baseline"]
    assert base["victim"]["requests"] >= 3 and base["victim"]["ttft_s"]["p99"] is not None
    for name in ("stored", "grpc"):
        p = rep["phases"][name]
        assert set(p["targets"]) == set(TARGETS) and p["health_ms"]["probes"] > 5
        assert p["attacker"]["requests"] > 0 and p["memory"]["rss_bytes"]["peak"] > 0
        assert p["ratios"]["ttft_p99"] is not None
    stored = rep["phases"]["stored"]["attacker"]
    assert stored["kinds"] == {"stored": stored["requests"]} and stored["statuses"].get("200")
    grpc = rep["phases"]["grpc"]["attacker"]
    assert set(grpc["kinds"]) == {"grpc_0", "grpc_1", "grpc_2", "grpc_3"}
    assert rep["victim_overall"]["lost"] == 0 and rep["victim_overall"]["statuses"] == {
        "200": rep["victim_overall"]["requests"]}


def test_redis_mode_samples_used_memory_and_leaves_no_keys(tmp_path, redis_url):
    """Over Redis, the watermark is judged on sampled used_memory, and the run's keys (stored
    responses live for 30 days) are deleted once the gateway stops."""
    import redis

    from loadtest.hostile import run

    out = tmp_path / "hostile.json"
    assert run(_args(["--fake-step-ms", "5", "--patterns", "stored", "--window-s", "2",
                      "--redis-url", redis_url, "--redis-watermark-mb", "4096",
                      "--json", str(out)])) == 0
    rep = json.loads(out.read_text())
    stored = rep["phases"]["stored"]
    assert stored["memory"]["redis_used_memory"]["peak"] > 0
    assert stored["targets"]["redis_watermark"] == "PASS"
    prefix = rep["settings"]["store_prefix"]
    assert prefix.startswith("specgate-hostile-")
    with redis.Redis.from_url(redis_url) as client:
        assert not list(client.scan_iter(match=prefix + "*", count=1000))


def test_a_refusal_cut_before_its_body_was_read_is_not_counted_unnamed():
    # the window's end cancels a follower while it reads a 429's body: its code was never seen
    cut = Outcome("follow", 0.0, status=429, cut=True)
    bare = Outcome("follow", 0.0, status=429)
    named = Outcome("follow", 0.0, status=429, code="concurrency_exceeded")
    summary = attacker_summary([cut, bare, named])
    assert summary["unnamed_refusals"] == 1 and summary["unnamed_details"] == {"HTTP 429": 1}
    assert summary["codes"] == {"concurrency_exceeded": 1} and summary["cut"] == 1
