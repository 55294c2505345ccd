"""`specgate loadtest hostile`: the flags, and the run: a quiet baseline, each pattern in turn
with the gateway waited out after it, a quiet window after the last, then the report."""
from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from loadtest.hostile import target as tg
from loadtest.hostile.attacks import PATTERNS, AttackResult, AttackSpec, run_attack
from loadtest.hostile.report import Phase, Targets, build_report, health_summary, summary
from loadtest.hostile.victim import HealthProbe, MemorySampler, Victim
from loadtest.results import write_result

IDLE_SETTLE_S = 1.0      # the gateway idle this long (besides the victim) counts as settled
WARMUP_S = 5.0           # of the victim alone, before the baseline and left out of it


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--patterns", default=",".join(PATTERNS),
                   help="comma-separated, run in this order, from: " + ", ".join(PATTERNS))
    p.add_argument("--window-s", type=float, default=20.0,
                   help="seconds of each pattern (and of the quiet baseline before them)")
    p.add_argument("--url", help="attack this running gateway (default: start `specgate serve`)")
    p.add_argument("--victim-key", help="with --url: the victim tenant's API key")
    p.add_argument("--attacker-key", help="with --url: the attacker tenant's API key")
    p.add_argument("--admin-key", help="with --url: an admin key, to read /metrics (live "
                   "requests, to wait out an attack; a loop-lag series where there is one)")
    p.add_argument("--grpc-target", help="with --url: the gateway's gRPC host:port")
    p.add_argument("--model", help="the model to serve (default: serve's default) and whose "
                   "tokenizer gives the byte token")
    p.add_argument("--redis-url", help="serve over this Redis (Redis mode) and sample its "
                   "used_memory")
    p.add_argument("--redis-watermark-mb", type=float, default=256.0,
                   help="Redis used_memory the run must stay under (Redis mode)")
    p.add_argument("--rpm", type=int, default=1000, help="each tenant's requests per minute")
    p.add_argument("--tpm", type=int, default=5_000_000, help="each tenant's tokens per minute")
    p.add_argument("--max-concurrent", type=int, default=64,
                   help="each tenant's concurrent requests")
    p.add_argument("--concurrency", type=int, default=8,
                   help="the attacker's request loops in the request patterns")
    p.add_argument("--followers", type=int, default=64, help="concurrent followers (followers)")
    p.add_argument("--idle-streams", type=int, default=32, help="streams never read (idle)")
    p.add_argument("--long-tokens", type=int, default=2000,
                   help="max tokens of the attacker's long outputs (bytes, followers, idle)")
    p.add_argument("--victim-interval-s", type=float, default=0.5,
                   help="the victim sends a short streamed chat this often (open loop)")
    p.add_argument("--victim-max-tokens", type=int, default=8,
                   help="max_tokens of each victim request")
    p.add_argument("--drain-s", type=float, default=180.0,
                   help="after a pattern, wait at most this long for the gateway to be idle")
    p.add_argument("--json", type=Path, help="write the report here")
    # tests: the gateway on the scheduler's fake worker
    p.add_argument("--fake-step-ms", type=float, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    patterns = [x.strip() for x in args.patterns.split(",") if x.strip()]
    unknown = [x for x in patterns if x not in PATTERNS]
    if unknown or not patterns:
        raise ValueError(f"--patterns: unknown {', '.join(unknown) or '(none)'}; "
                         f"from: {', '.join(PATTERNS)}")
    if args.window_s <= 0:
        raise ValueError("--window-s must be > 0")
    targets = Targets(redis_watermark_bytes=int(args.redis_watermark_mb * 2**20))
    spec = AttackSpec(pattern="", url="", key="", model="", window_s=args.window_s,
                      concurrency=args.concurrency, followers=args.followers,
                      idle_streams=args.idle_streams, long_tokens=args.long_tokens)
    report = _with_target(args, lambda t: hostile(t, patterns, spec, targets, args))
    if args.json:
        write_result(args.json, report)
    print(summary(report))
    return 0


def _with_target(args: argparse.Namespace, body: Any) -> dict[str, Any]:
    if args.url:
        if not (args.victim_key and args.attacker_key):
            raise ValueError("--url needs --victim-key and --attacker-key")
        return body(tg.Target(args.url.rstrip("/"), args.victim_key, args.attacker_key,
                              args.admin_key, args.grpc_target, None, args.redis_url))
    quotas = tg.Quotas(args.rpm, args.tpm, args.max_concurrent)
    _say("starting specgate serve" + (" over Redis" if args.redis_url else "")
         + (" on the fake worker" if args.fake_step_ms is not None else ""))
    with tg.served(model=args.model, redis_url=args.redis_url, quotas=quotas,
                   fake_step_ms=args.fake_step_ms) as target:
        return body(target)


def hostile(target: tg.Target, patterns: list[str], spec: AttackSpec, targets: Targets,
            args: argparse.Namespace) -> dict[str, Any]:
    """The run against `target` (module docstring); returns the report."""
    import multiprocessing

    load_before = _load_average()
    _say(f"gateway ready at {target.url}")
    model = _model_id(target)
    spec = replace(spec, url=target.url, key=target.attacker_key, model=model,
                   grpc_target=target.grpc_target,
                   byte_token=None if args.fake_step_ms is not None else _byte_token(args.model))
    victim = Victim(target.url, target.victim_key, model, interval_s=args.victim_interval_s,
                    max_tokens=args.victim_max_tokens)
    probe = HealthProbe(target.url)
    sampler = MemorySampler(_redis_reader(target), _rss_reader(target))
    phases: list[Phase] = []
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=ctx) as attacker:
        attacker.submit(time.monotonic).result()           # the attacker's process, started
        for thread in (sampler, probe, victim):
            thread.start()
        try:
            time.sleep(min(WARMUP_S, args.window_s))      # first requests' one-time costs
            _say(f"baseline: {args.window_s:g} s of the victim alone")
            phases.append(_quiet("baseline", args.window_s, target))
            idle_ms = _idle_health_ms(probe, phases[0], targets.health_ms)
            for name in patterns:
                _say(f"{name}: {args.window_s:g} s")
                lag = _loop_lag(target)
                result: AttackResult = attacker.submit(run_attack, replace(spec, pattern=name)).result()
                phases.append(_settle(result, target, victim, probe, args.drain_s, idle_ms, lag))
                _say(f"{name}: {len(result.outcomes)} attacker requests; the gateway idle "
                     f"{phases[-1].settled - phases[-1].ended:.1f} s after the window")
            _say(f"after: {args.window_s:g} s of the victim alone")
            phases.append(_quiet("after", args.window_s, target))
        finally:
            victim.stop(timeout=180)
            probe.stop()
            sampler.stop()
    settings = {"url": target.url if args.url else "started: specgate serve",
                "model": model, "redis": bool(target.redis_url),
                "store_prefix": target.store_prefix, "patterns": patterns,
                "window_s": args.window_s, "quotas": {"rpm": args.rpm, "tpm": args.tpm,
                                                      "max_concurrent": args.max_concurrent},
                "attacker": {"concurrency": spec.concurrency, "followers": spec.followers,
                             "idle_streams": spec.idle_streams, "long_tokens": spec.long_tokens,
                             "byte_token": spec.byte_token},
                "victim": {"interval_s": args.victim_interval_s,
                           "max_tokens": args.victim_max_tokens},
                "fake_worker": args.fake_step_ms is not None,
                # the machine's 1-minute load average as the run began and ended: on shared cores
                # other work slows the baseline and the attacks alike, and this says how much
                "load_average": [load_before, _load_average()]}
    return build_report(phases, victim.samples, probe.probes, sampler.samples, targets, settings)


def _load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _say(text: str) -> None:
    print(f"hostile {time.strftime('%H:%M:%S')}: {text}", file=sys.stderr, flush=True)


def _quiet(name: str, window_s: float, target: tg.Target) -> Phase:
    """A window of the victim alone."""
    lag = _loop_lag(target)
    t0 = time.monotonic()
    time.sleep(window_s)
    ended = time.monotonic()
    return Phase(name, t0, ended, ended, loop_lag=tg.lag_between(lag, _loop_lag(target)),
                 attack=False)


def _idle_health_ms(probe: HealthProbe, baseline: Phase, health_ms: float) -> float:
    """What /health may take on a gateway that is idle again: the target, or twice the quiet
    baseline's p99 where the machine is too busy for even an idle gateway to meet it."""
    quiet = health_summary([q for q in list(probe.probes)
                            if baseline.started <= q.t < baseline.ended])["p99"]
    return max(health_ms, 2 * quiet) if quiet is not None else health_ms


def _settle(result: AttackResult, target: tg.Target, victim: Victim, probe: HealthProbe,
            drain_s: float, health_ms: float, lag: dict[str, float] | None) -> Phase:
    """The pattern's phase, once the gateway is idle again for IDLE_SETTLE_S, or `drain_s` has
    passed: no live requests beyond the victim's own (where /metrics can be read) and every
    /health probe answered within `health_ms` (work in the front, e.g. parsing bodies whose
    clients are gone, holds no request yet still slows everyone). `lag`: the gateway's loop-lag
    histogram as it stood before the attack, so the phase reports the lag measured since."""
    notes = list(result.notes)
    deadline = time.monotonic() + drain_s
    quiet_since = None
    while True:
        now = time.monotonic()
        live = _live(target)
        recent = [q for q in list(probe.probes) if q.t >= now - IDLE_SETTLE_S]
        busy = (live is not None and live > victim.in_flight) or not recent or any(
            q.latency is None or q.latency * 1000 > health_ms for q in recent)
        quiet_since = None if busy else (quiet_since or now)
        if quiet_since is not None and now - quiet_since >= IDLE_SETTLE_S:
            break
        if now > deadline:
            notes.append(f"drain: not idle after {drain_s:g} s (live requests: {live})")
            break
        time.sleep(0.25)
    settled = max(time.monotonic(), result.ended)
    return Phase(result.pattern, result.started, result.ended, settled, tuple(result.outcomes),
                 tuple(notes), loop_lag=tg.lag_between(lag, _loop_lag(target)),
                 skipped=result.skipped)


def _live(target: tg.Target) -> float | None:
    samples = tg.read_metrics(target)
    return tg.live_requests(samples) if samples is not None else None


def _loop_lag(target: tg.Target) -> dict[str, float] | None:
    samples = tg.read_metrics(target)
    return tg.loop_lag(samples) if samples is not None else None


def _model_id(target: tg.Target) -> str:
    import httpx

    r = httpx.get(f"{target.url}/v1/models", timeout=30,
                  headers={"Authorization": f"Bearer {target.victim_key}"})
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def _byte_token(model: str | None) -> int | None:
    """A token of the served model's tokenizer that decodes alone to U+FFFD, if any."""
    from loadtest.hostile.bodies import byte_token_ids
    from workers.model.loader import DEFAULT_MODEL, load_tokenizer

    ids = byte_token_ids(load_tokenizer(model or DEFAULT_MODEL, progress=False), limit=1)
    return ids[0] if ids else None


def _redis_reader(target: tg.Target) -> Any:
    if not target.redis_url:
        return lambda: None
    import redis

    client = redis.Redis.from_url(target.redis_url, socket_timeout=5)
    return lambda: tg.redis_used_memory(client)


def _rss_reader(target: tg.Target) -> Any:
    pid = target.pid
    return (lambda: None) if pid is None else (lambda: tg.rss_bytes(pid))
