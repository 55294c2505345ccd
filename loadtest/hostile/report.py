"""The hostile load test's report: pure arithmetic over the run's records, then PASS/FAIL per
pattern against the targets, and the text the command prints.

A pattern's window is [started, ended): the victim's latencies and the /health probes of the
requests and probes that began in it. Whatever the attack leaves running is waited out after the
window (`settled`, the drain); the victim's requests that began before the gateway settled,
the status codes and the memory peak count it in, since harm that outlives the attack is harm.

Targets, each PASS, FAIL or n/a (nothing to judge):
    victim_ttft_p99, victim_tbt_p99   the victim's p99 TTFT and time between tokens within
                                      `latency_ratio` (1.5) × the quiet baseline of the same run
    health                            /health p99 within `health_ms` (100 ms), every probe a 200
                                      (the max is reported beside it)
    no_5xx                            no server error to either tenant (a 5xx status, a gRPC
                                      INTERNAL/UNAVAILABLE, or a server failure inside a stream)
    refusals_named                    every refusal of the attacker a 4xx naming its cap (`code`)
    redis_watermark                   Redis used_memory stays within the watermark (Redis mode)
    nothing_lost                      every victim request answered in full (VictimSample.complete)

The `busy` phase is no attack but the yardstick: an ordinary neighbour keeping the batch full.
Every step then costs more than the quiet baseline's, so the victim's ratios under it are the
least that sharing the verifier costs; each pattern's p99s are also given as ratios to it
(`ratios_to_busy`), which say what the pattern costs beyond being a busy neighbour.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from loadtest.hostile.attacks import REFERENCE
from loadtest.hostile.records import MemorySample, Outcome, Probe, VictimSample
from loadtest.loadgen import quantile

TARGETS = ("victim_ttft_p99", "victim_tbt_p99", "health", "no_5xx", "refusals_named",
           "redis_watermark", "nothing_lost")


@dataclass(frozen=True)
class Targets:
    latency_ratio: float = 1.5
    health_ms: float = 100.0
    redis_watermark_bytes: int | None = None


@dataclass(frozen=True)
class Phase:
    """One window of the run: the quiet baseline, an attack pattern, or the quiet one after."""
    name: str
    started: float
    ended: float                        # the window's end
    settled: float                      # when the gateway was idle again (≥ ended)
    outcomes: tuple[Outcome, ...] = ()  # the attacker's
    notes: tuple[str, ...] = ()
    loop_lag: dict[str, Any] | None = None      # the gateway's loop lag over it (target.lag_between)
    attack: bool = True
    skipped: bool = False               # an attack that could not run here: judged on nothing


# ---- arithmetic --------------------------------------------------------------------------------
def spread(xs: Sequence[float]) -> dict[str, float | None]:
    """p50, p99 (nearest rank) and max of `xs`; None each when empty."""
    if not xs:
        return {"p50": None, "p99": None, "max": None}
    return {"p50": quantile(list(xs), 0.50), "p99": quantile(list(xs), 0.99), "max": max(xs)}


def ratio(value: float | None, base: float | None) -> float | None:
    """value ÷ base, None when either is missing or the base is not positive."""
    if value is None or base is None or base <= 0:
        return None
    return value / base


def counts(keys: Iterable[Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    for k in keys:
        out[str(k)] = out.get(str(k), 0) + 1
    return dict(sorted(out.items()))


def within(t: float, start: float, end: float) -> bool:
    return start <= t < end


# ---- one phase ---------------------------------------------------------------------------------
def victim_summary(samples: Sequence[VictimSample]) -> dict[str, Any]:
    """The victim's requests: how many, how many complete, their TTFT and gaps, and statuses."""
    done = [s for s in samples if s.complete]
    return {"requests": len(samples), "complete": len(done), "lost": len(samples) - len(done),
            "ttft_s": spread([s.ttft for s in done if s.ttft is not None]),
            "tbt_s": spread([g for s in done for g in s.gaps]),
            "statuses": counts(s.status for s in samples),
            "codes": counts(s.code for s in samples if s.code is not None),
            "server_errors": sum(s.server_error or s.status >= 500 for s in samples)}


def health_summary(probes: Sequence[Probe]) -> dict[str, Any]:
    """/health latency in milliseconds (of the probes a 200 answered) and the failed probes."""
    ok = [1000 * p.latency for p in probes if p.latency is not None]
    return {**spread(ok), "probes": len(probes), "failed": len(probes) - len(ok)}


def attacker_summary(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """The attacker's requests by kind and status, the codes it was refused with, and the
    refusals that named no code (with what they said instead)."""
    refused = [o for o in outcomes if o.status >= 400]
    # a refusal whose body the attacker stopped reading when its window ended said nothing yet
    unnamed = [o for o in refused if o.code is None and not o.cut]
    return {"requests": len(outcomes), "kinds": counts(o.kind for o in outcomes),
            "statuses": counts("cut" if o.cut and o.status == 0 else o.status for o in outcomes),
            "codes": counts(o.code for o in outcomes if o.code is not None),
            "unanswered": sum(1 for o in outcomes if o.status == 0 and not o.cut),
            "cut": sum(o.cut for o in outcomes),
            "server_errors": sum(o.server_error or o.status >= 500 for o in outcomes),
            "unnamed_refusals": len(unnamed),
            "unnamed_details": counts(o.detail or f"HTTP {o.status}" for o in unnamed)}


def memory_summary(samples: Sequence[MemorySample], before: MemorySample | None) -> dict[str, Any]:
    """Redis used_memory and the gateway's RSS: at the phase's start (the last sample before it)
    and their peak within it."""
    def of(read: Callable[[MemorySample], int | None]) -> dict[str, int | None]:
        values = [v for s in samples if (v := read(s)) is not None]
        return {"start": read(before) if before is not None else None,
                "peak": max(values, default=None)}
    return {"redis_used_memory": of(lambda s: s.redis_used_memory),
            "rss_bytes": of(lambda s: s.rss_bytes)}


def verdicts(p: dict[str, Any], baseline: dict[str, Any] | None, targets: Targets) -> dict[str, str]:
    """PASS/FAIL/n/a per target (module docstring) for one phase's report `p`."""
    v = p["victim"]

    def latency(metric: str) -> str:
        r = p["ratios"][f"{metric}_p99"]
        if r is not None:
            return "PASS" if r <= targets.latency_ratio else "FAIL"
        if baseline is None or baseline["victim"][f"{metric}_s"]["p99"] is None:
            return "n/a"
        return "FAIL" if v["requests"] else "n/a"      # requests, none of them complete

    h, a = p["health_ms"], p["attacker"]
    peak = p["memory"]["redis_used_memory"]["peak"]
    return {
        "victim_ttft_p99": latency("ttft"),
        "victim_tbt_p99": latency("tbt"),
        "health": "n/a" if not h["probes"] else
                  "PASS" if not h["failed"] and h["p99"] is not None and h["p99"] <= targets.health_ms
                  else "FAIL",
        "no_5xx": "PASS" if p["server_errors"] == 0 else "FAIL",
        "refusals_named": "PASS" if a["unnamed_refusals"] == 0 else "FAIL",
        "redis_watermark": "n/a" if peak is None or targets.redis_watermark_bytes is None else
                           "PASS" if peak <= targets.redis_watermark_bytes else "FAIL",
        "nothing_lost": "PASS" if p["victim_until_settled"]["lost"] == 0 else "FAIL",
    }


def phase_report(phase: Phase, victim: Sequence[VictimSample], probes: Sequence[Probe],
                 memory: Sequence[MemorySample], baseline: dict[str, Any] | None,
                 targets: Targets) -> dict[str, Any]:
    """One phase's figures, its ratios to the baseline's and (for an attack) its verdicts."""
    in_window = [s for s in victim if within(s.scheduled, phase.started, phase.ended)]
    until_settled = [s for s in victim if within(s.scheduled, phase.started, max(phase.settled, phase.ended))]
    before = [m for m in memory if m.t < phase.started]
    p: dict[str, Any] = {
        "window_s": round(phase.ended - phase.started, 3),
        "drain_s": round(max(0.0, phase.settled - phase.ended), 3),
        "victim": victim_summary(in_window),
        "victim_until_settled": {k: victim_summary(until_settled)[k]
                                 for k in ("requests", "complete", "lost", "statuses")},
        "health_ms": health_summary([q for q in probes if within(q.t, phase.started, phase.ended)]),
        "attacker": attacker_summary(phase.outcomes),
        "memory": memory_summary([m for m in memory if phase.started <= m.t <= phase.settled],
                                 before[-1] if before else None),
        "loop_lag": phase.loop_lag,
        "notes": list(phase.notes),
    }
    base = baseline["victim"] if baseline is not None else None
    p["ratios"] = {f"{m}_{q}": ratio(p["victim"][f"{m}_s"][q], base[f"{m}_s"][q] if base else None)
                   for m in ("ttft", "tbt") for q in ("p50", "p99")}
    p["server_errors"] = (victim_summary(until_settled)["server_errors"]
                          + p["attacker"]["server_errors"])
    if phase.attack and phase.skipped:
        p["verdict"] = "SKIPPED"
    elif phase.name == REFERENCE:
        p["verdict"] = "REFERENCE"             # judged by nothing: what the others are held to
    elif phase.attack:
        p["targets"] = verdicts(p, baseline, targets)
        p["verdict"] = "FAIL" if "FAIL" in p["targets"].values() else "PASS"
    return p


def build_report(phases: Sequence[Phase], victim: Sequence[VictimSample],
                 probes: Sequence[Probe], memory: Sequence[MemorySample], targets: Targets,
                 settings: dict[str, Any]) -> dict[str, Any]:
    """Every phase's report, the first (quiet) one as the baseline the others are held to."""
    out: dict[str, Any] = {"settings": settings, "targets": {
        "latency_ratio": targets.latency_ratio, "health_ms": targets.health_ms,
        "redis_watermark_bytes": targets.redis_watermark_bytes}}
    baseline = None
    phases_out: dict[str, Any] = {}
    for phase in phases:
        phases_out[phase.name] = phase_report(phase, victim, probes, memory, baseline, targets)
        if baseline is None:
            baseline = phases_out[phase.name]
    reference = phases_out.get(REFERENCE)
    if reference is not None:                  # beside the quiet baseline: a full batch's cost
        for name, p in phases_out.items():
            if name != REFERENCE and "verdict" in p:
                p["ratios_to_busy"] = {
                    f"{m}_p99": ratio(p["victim"][f"{m}_s"]["p99"], reference["victim"][f"{m}_s"]["p99"])
                    for m in ("ttft", "tbt")}
    out["phases"] = phases_out
    out["victim_overall"] = {k: victim_summary(victim)[k]
                             for k in ("requests", "complete", "lost", "statuses", "codes")}
    out["verdicts"] = {name: p["verdict"] for name, p in phases_out.items() if "verdict" in p}
    return out


# ---- text --------------------------------------------------------------------------------------
def summary(report: dict[str, Any]) -> str:
    """A line per phase: the victim's p99s (and their ratios), /health, statuses, verdict; then
    the failed targets of each pattern."""
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{1000 * x:.0f}"

    def x(r: float | None) -> str:
        return "" if r is None else f" ({r:.2f}x)"

    lines = [f"{'phase':<10} {'ttft p99 ms':>16} {'tbt p99 ms':>16} {'health p99/max ms':>18} "
             f"{'lost':>5} {'5xx':>4}  attacker statuses  verdict"]
    for name, p in report["phases"].items():
        v, h, r = p["victim"], p["health_ms"], p["ratios"]
        health = "-" if h["p99"] is None else f"{h['p99']:.0f}/{h['max']:.0f}"
        statuses = ",".join(f"{k}:{n}" for k, n in p["attacker"]["statuses"].items()) or "-"
        lines.append(f"{name:<10} {ms(v['ttft_s']['p99']) + x(r['ttft_p99']):>16} "
                     f"{ms(v['tbt_s']['p99']) + x(r['tbt_p99']):>16} {health:>18} "
                     f"{p['victim_until_settled']['lost']:>5} {p['server_errors']:>4}  "
                     f"{statuses:<18} {p.get('verdict', '')}")
    for name, p in report["phases"].items():
        if (rb := p.get("ratios_to_busy")) is not None:
            lines.append(f"{name}: beside a busy neighbour's p99s (ttft, tbt){x(rb['ttft_p99'])}"
                         f"{x(rb['tbt_p99'])}")
    for name, p in report["phases"].items():
        failed = [t for t, verdict in p.get("targets", {}).items() if verdict == "FAIL"]
        if failed:
            lines.append(f"{name}: FAIL {', '.join(failed)}")
    return "\n".join(lines)
