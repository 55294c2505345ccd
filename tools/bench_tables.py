"""Markdown tables of benchmark results, one function per result format (tools/bench_docs.py picks
which for each benchmark). Each takes a result's JSON (its `meta` aside) and returns lines.

They read what the benchmark writes and nothing else: a figure on docs/benchmarks.md is always
one of a result file's, rounded, never typed in by hand. A key a run did not record is shown as
"–", so an older result still renders after a benchmark gains a figure.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Sequence

Doc = Mapping[str, Any]
Table = Callable[[Doc], list[str]]
DASH = "–"


# ---- cells ------------------------------------------------------------------------------------------
def num(x: Any, digits: int = 2) -> str:
    """A figure as the page shows it: fixed decimals, thousands separated, "–" when missing."""
    if x is None or x == "":
        return DASH
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        return f"{x:,.{digits}f}"
    return str(x)


def ms(seconds: Any, digits: int = 1) -> str:
    return DASH if seconds is None else num(1000 * seconds, digits)


def times(x: Any, digits: int = 3) -> str:
    return DASH if x is None else num(x, digits) + "×"


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    def cell(v: Any) -> str:
        return str(v).replace("|", "\\|").replace("\n", " ")
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return out


def pairs(doc: Doc, picks: Sequence[tuple[str, str, Callable[[Any], str]]]) -> list[str]:
    """A two-column table of the figures in `picks` (label, key, format) that `doc` holds."""
    return table(("figure", "value"), [(label, fmt(doc[key])) for label, key, fmt in picks
                                       if key in doc])


def settings_line(settings: Doc) -> list[str]:
    shown = ", ".join(f"{k} {_setting(v)}" for k, v in settings.items() if v not in (None, {}, []))
    return [f"Settings: {shown}.", ""] if shown else []


def _setting(v: Any) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (list, tuple)):
        return ",".join(map(str, v))
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} {_setting(x)}" for k, x in v.items()) + "}"
    return num(v, 3) if isinstance(v, float) else str(v)


# ---- one function per format ----------------------------------------------------------------------
def engine(doc: Doc) -> list[str]:
    """`bench engine`: single stream against transformers, or --concurrency N against plain."""
    return pairs(doc, [
        ("workloads", "workloads", _setting), ("workload", "workload", str),
        ("drafter", "drafter", str), ("CPU kernels", "cpu_kernels", str), ("concurrency", "concurrency", num),
        ("rounds", "rounds", num), ("tree budget", "tree_budget", _setting),
        ("specgate tokens/s", "specgate_tok_s", num), ("plain tokens/s", "specgate_plain_tok_s", num),
        ("speculative tokens/s (all streams)", "total_tokens_per_s", num),
        ("plain tokens/s (all streams)", "plain_total_tokens_per_s", num),
        ("× plain decoding", "speedup_vs_plain", times),
        ("× plain decoding", "speedup_vs_specgate_plain", times),
        ("× plain, each round", "speedup_vs_plain_by_round", lambda v: ", ".join(num(x) for x in v)),
        ("transformers greedy tokens/s (one stream)", "hf_greedy_tok_s", num),
        ("× transformers greedy", "speedup_vs_hf_greedy", times),
        ("× transformers prompt lookup", "speedup_vs_hf_prompt_lookup", times),
        ("τ", "tau_mean", lambda v: num(v, 3)), ("steps", "steps", num),
        ("plain steps", "plain_steps", num), ("output identical to plain", "identical", num)])


def drafters(doc: Doc) -> list[str]:
    """`bench drafters`: τ, acceptance, drafting cost and the measured against predicted multiplier."""
    rows = []
    for name, d in doc["drafters"].items():
        level = d.get("draft_ms_per_level")
        cost = DASH if not level else f"{num(level)} ({num(d.get('draft_vs_target'), 3)})"
        rounds = d.get("multiplier_by_round")
        rows.append((name, num(d.get("tau"), 3), num(d.get("alpha") or None, 3), cost,
                     num(d.get("tokens_per_s"), 1),
                     times(d.get("multiplier_measured", 1.0 if name == "none" else None)),
                     DASH if not rounds or name == "none" else ", ".join(num(r) for r in rounds),
                     times(d.get("multiplier_predicted"))))
    mode = "sized by the planner" if doc.get("adaptive") else "the whole budget every step"
    shape = "chain" if doc.get("chain") else "tree"
    budget = doc.get("tree_budget", {})
    return [f"{doc.get('prompts')} prompts × {doc.get('max_tokens')} tokens, {shape} of "
            f"{budget.get('max_nodes')} nodes / depth {budget.get('max_depth')}, {mode}; "
            f"output identical to plain decoding: {num(doc.get('identical'))}.", "",
            *table(("drafter", "τ", "α", "draft ms/level (× target step)", "tokens/s",
                    "measured ×", "each round", "predicted ×"), rows)]


def draft_train(doc: Doc) -> list[str]:
    """`draft train`'s summaries, one run per row."""
    rows = []
    for name, r in doc["runs"].items():
        gates = r.get("memory_gate")
        rows.append((name, "yes" if r.get("memory_layers") else "no", num(r.get("k")),
                     num(r.get("weight"), 1), num(r.get("steps")), num(r.get("train_sequences")),
                     f"{num(r.get('alpha_before'), 3)} → {num(r.get('alpha_after'), 3)}",
                     DASH if not gates else ", ".join(num(g) for g in gates)))
    return table(("run", "feedback memory", "k", "ω", "steps", "training sequences",
                  "α at depth 1, before → after", "memory gates at the end"), rows)


def front(doc: Doc) -> list[str]:
    """`bench front`: what each abusive request got, and how long /health waited beside it."""
    idle = doc["idle_health_ms"]
    rows = []
    for key, what in (("huge", "a prompt past the characters bound"),
                      ("tokenized", "a prompt just under it (tokenized in full)"),
                      ("over_rpm", "a huge prompt from a tenant over its rpm")):
        r = doc.get(key)
        if r:
            secs = r["seconds"]
            rows.append((what, num(r["chars"]), ", ".join(map(str, r["statuses"])),
                         f"{num(min(secs), 3)}–{num(max(secs), 3)}",
                         f"{num(r['worst_health_ms'])} ({num(r['health_delay_ms'])})"))
    return [f"Idle /health: median {num(idle['median'])} ms, max {num(idle['max'])} ms.", "",
            *table(("request", "characters", "status", "seconds", "worst /health ms "
                    "(delay over the idle median)"), rows)]


def stall(doc: Doc) -> list[str]:
    """`bench stall`: the worst stream's gaps while a long prompt is prefilled, per chunk size."""
    rows = []
    for chunk, r in doc["runs"].items():
        w = r["worst_stream"]
        rows.append((chunk, f"{num(w['median_gap_ms'], 1)} / {num(w.get('median_gap_after_ms'), 1)}",
                     f"{num(w['p50_gap_during_ms'], 1)} / {num(w['p90_gap_during_ms'], 1)} / "
                     f"{num(w['max_gap_during_ms'], 1)}", num(r["stall_ratio"]),
                     num(r.get("stall_ratio_vs_after")), num(r["long_latency_s"], 1)))
    return [*settings_line(doc.get("settings", {})),
            *table(("--prefill-chunk-tokens", "stream's median gap before / after, ms",
                    "gaps during: p50 / p90 / max, ms", "max ÷ median before",
                    "max ÷ median after", "the long prompt's latency, s"), rows)]


def kv(doc: Doc) -> list[str]:
    """`bench kv`: RSS, KV held, residents, preemptions and tokens under each KV budget."""
    rows = [(mb, num(r["budget_tokens"]), num(r["rss_before_requests_gib"]),
             f"{num(r['peak_rss_gib'])} ({num(r['bound_gib'])})", num(r["peak_kv_gib"]),
             num(r["most_resident"]), num(r["preemptions"]), num(r["failed"]),
             num(r["tokens_generated"])) for mb, r in doc["runs"].items()]
    return [*settings_line(doc.get("settings", {})),
            *table(("--kv-cache-mb", "slots", "RSS before requests, GiB",
                    "peak RSS (bound), GiB", "peak KV held, GiB", "most resident", "preemptions",
                    "failed", "tokens generated"), rows)]


def lengths(doc: Doc) -> list[str]:
    """`bench lengths`: the predictor against the tenant-record baseline, at arrival and as a
    request runs, and per kind of work."""
    base = doc["baseline"]
    head = table(("predictor", "Spearman ρ", "median \\|ln(pred ÷ true)\\|"),
                 [("hidden state (held-out split)", num(doc["spearman"], 3),
                   num(doc["median_abs_log_error"], 3)),
                  ("tenant records only", num(base["spearman"], 3),
                   num(base["median_abs_log_error"], 3))])
    checks = table(("tokens committed", "requests", "ρ", "σ of ln(remaining)"),
                   [(num(c["committed"]), num(c["n"]), num(c["spearman"], 3), num(c["sigma"], 3))
                    for c in doc.get("checkpoints", ())])
    kinds = table(("kind", "prompts", "ρ", "median true length", "median predicted"),
                  [(k, num(v["n"]), num(v["spearman"], 3), num(v["median_length"], 0),
                    num(v["median_predicted"], 0)) for k, v in doc.get("per_kind", {}).items()])
    return [f"{num(doc['records'])} prompts ({num(doc['train'])} train / {num(doc['test'])} "
            f"test), {num(doc['capped'])} of them run to the cap; ridge {num(doc['ridge'], 0)}.",
            "", *head, "", "Re-predicted as a request runs:", "", *checks, "", "Per kind:", "",
            *kinds]


def lengths_mix(doc: Doc) -> list[str]:
    """`bench lengths --loadtest-mix`: the shipped weights on the load test's own prompts."""
    rows = [(w, num(v["spearman"], 3), num(v["ran_to_cap"]), num(len(v.get("true_lengths", ()))))
            for w, v in doc["per_workload"].items()]
    return [f"{num(doc['prompts'])} prompts, cap {num(doc['cap'])} tokens, "
            f"{num(doc['ran_to_cap'])} ran to it; Spearman ρ {num(doc['spearman'], 3)}, median "
            f"\\|ln(pred ÷ true)\\| {num(doc['median_abs_log_error'], 3)} overall.", "",
            *table(("workload", "ρ", "ran to the cap", "prompts"), rows)]


def profile(doc: Doc) -> list[str]:
    """`bench profile`: step time by batch and tree tokens, prefill and the prefill-chunk fit."""
    curves = doc["curves"]
    nodes = curves[0]["nodes"]
    rows = [(c["batch"], *(ms(s) for s in c["step_s"])) for c in curves]
    out = [f"{doc.get('device', '')}; context {doc.get('prompt_len')} tokens. Step time, ms:", "",
           *table(("batch", *(f"{n} node{'' if n == 1 else 's'} each" for n in nodes)), rows)]
    pre = doc.get("prefill")
    if pre:
        out += ["", "Prefill, ms: " + ", ".join(f"{num(t)} tokens {ms(s, 0)}"
                                               for t, s in zip(pre["tokens"], pre["step_s"])) + "."]
    chunk = doc.get("chunk")
    if chunk:
        out += ["", f"A prefill chunk beside a batch of {chunk['batch']}: "
                f"{ms(chunk['row_s'], 2)} ms a row + {num(1e6 * chunk['key_s'], 2)} µs a row per "
                "earlier key.", "",
                *table(("keys before the chunk", "chunk tokens", "ms added to the step"),
                       [(num(k), num(t), ms(s)) for k, t, s in chunk["points"]])]
    return out


def structured(doc: Doc) -> list[str]:
    """`bench structured`: every shipped schema under each drafter, against plain constrained
    decoding."""
    rows = [(name, num(d["tokens_per_s"], 1), times(d["speedup_vs_plain"], 2), num(d["tau"], 2),
             num(d["acceptance"], 2), f"{num(d['valid_pct'], 1)}%",
             f"{d['identical_to_plain']} of {doc['settings']['schemas']}")
            for name, d in doc["drafters"].items()]
    invalid = sorted({s for d in doc["drafters"].values() for s in d.get("invalid", ())})
    tail = [f"Outputs that do not validate: {', '.join(invalid)}."] if invalid else []
    return [*settings_line(doc.get("settings", {})),
            *table(("drafter", "tokens/s", "× plain", "τ", "acceptance", "valid",
                    "identical to plain"), rows), "", *tail]


def grammar_engines(doc: Doc) -> list[str]:
    """`bench grammar-engines`: mask cost per token and compile time per schema, per engine."""
    engines = doc["engines"]
    schemas = list(next(iter(engines.values()))["schemas"])
    rows = []
    for name, e in engines.items():
        if "schemas" not in e:
            rows.append((f"{name} ({e.get('error', 'not run')})", *([DASH] * (len(schemas) + 1))))
            continue
        rows.append((f"{name} {e.get('version', '')}".strip(), num(e["mean_per_token_us"], 1),
                     *(f"{num(e['schemas'][s]['per_token_us'], 1)} ({num(e['schemas'][s]['compile_ms'], 1)})"
                       for s in schemas)))
    return table(("engine", "mean µs a token", *(f"{s}: µs a token (compile ms)" for s in schemas)),
                 rows)


def resume(doc: Doc) -> list[str]:
    """`bench resume`: kill -9 mid-stream, restart, resume: tries passed per sampling mode."""
    rows = []
    for mode, m in doc["modes"].items():
        restarts = sorted(r["restart_s"] for r in m["rows"] if r.get("restart_s") is not None)
        median = restarts[len(restarts) // 2] if restarts else None
        rows.append((mode, f"{m['passed']} of {m['tries']}", num(m["reference_events"]),
                     num(median, 2)))
    return [f"Mode: {doc['mode']}; {num(doc['max_tokens'])} tokens a response.", "",
            *table(("sampling", "passed", "events a response", "median restart, s"), rows)]


def compare(doc: Doc) -> list[str]:
    """`loadtest compare`: one gateway per policy (or per setting) under the same arrivals."""
    rows = [(name, num(p["mean_latency_s"], 1), num(p["p50_latency_s"], 1),
             num(p["p99_latency_s"], 1), num(p.get("ttft_p50_s"), 1), num(p.get("mean_wait_s"), 1),
             num(p.get("mean_in_steps_s"), 1), num(p.get("itl_p99_s")),
             num(p.get("completed_per_s"), 3), num(p.get("output_tokens_per_s"), 1),
             f"{num(p['completed'])} of {num(p['requests'])}", num(p["errors"]))
            for name, p in doc["policies"].items()]
    out = [*settings_line({k: v for k, v in doc["settings"].items() if k != "gateway"}),
           *table(("gateway", "mean s", "p50 s", "p99 s", "TTFT p50 s", "waiting s", "in steps s",
                   "p99 gap between tokens s", "completed/s", "output tokens/s", "completed",
                   "errors"), rows)]
    if "laps_share_of_srpt" in doc:
        red = doc.get("laps_reduction_vs", {})
        out += ["", "laps' mean below " + ", ".join(f"{k}'s by {num(100 * v, 1)}%"
                                                   for k, v in red.items())
                + f"; share of clairvoyant srpt's reduction (fcfs − laps) ÷ (fcfs − srpt): "
                f"{num(doc['laps_share_of_srpt'])}."]
    return out + compare_intervals(doc.get("intervals"))


def compare_intervals(iv: Doc | None) -> list[str]:
    """`loadtest compare`'s bootstrap intervals (loadtest/bootstrap.py), where the run has them:
    each policy's figures, then each ratio against fcfs and sjf, as estimate [low, high]."""
    if not iv:
        return []
    figures = [k for k in ("mean_latency_s", "p99_latency_s", "ttft_p50_s", "ttft_p99_s") if k in iv]
    span = lambda c, f: f"{f(c['estimate'])} [{f(c['low'])}, {f(c['high'])}]"   # noqa: E731
    secs = lambda x: num(x, 2)                                                     # noqa: E731
    ratio = lambda x: num(x, 3)                                                    # noqa: E731
    policies = list(iv[figures[0]]["policies"]) if figures else []
    names = list(iv[figures[0]]["ratios"]) if figures else []
    head = [f"{num(100 * iv['level'], 0)}% bootstrap intervals over {len(iv['units'])} runs "
            f"({', '.join(iv['units'])}), paired by seed and round, {num(iv['resamples'])} "
            "resamples; a ratio is the first policy's figure ÷ the second's.", ""]
    return ["", *head,
            *table(("policy", *(f"{k[:-2]} s" for k in figures)),
                   [(p, *(span(iv[k]["policies"][p], secs) for k in figures)) for p in policies]),
            "",
            *table(("ratio", *(k[:-2] for k in figures)),
                   [(n, *(span(iv[k]["ratios"][n], ratio) for k in figures)) for n in names])]


def scheduler(doc: Doc) -> list[str]:
    """`bench scheduler`: plan + update per step by waiting and running requests, then the
    growth with queue length at each running count."""
    rows = [(num(c["waiting"]), num(c["running"]), num(c["homes"]), num(c["median_ms"], 3),
             num(c["p99_ms"], 3), num(c["plan_median_ms"], 3), num(c["update_median_ms"], 3),
             num(c.get("cpu_median_ms"), 3), num(c["mean_batch"], 0))
            for c in doc["configs"]]
    out = [*settings_line(doc.get("settings", {})),
           *table(("waiting", "running", "KV homes", "plan + update median ms", "p99 ms",
                   "plan median ms", "update median ms", "CPU median ms", "mean batch"), rows)]
    grown = doc.get("growth") or {}
    if grown:
        out += ["", "Growth of the median with queue length: "
                + "; ".join(f"{k}, {times(v, 2)}" for k, v in grown.items()) + "."]
    return out


def hostile(doc: Doc) -> list[str]:
    """`loadtest hostile`: per phase, the victim's p99s against the baseline, /health, what the
    attacker got, and PASS/FAIL with the targets that failed."""
    rows = []
    for name, p in doc["phases"].items():
        v, r, h, a = p["victim"], p["ratios"], p["health_ms"], p["attacker"]
        failed = [t for t, verdict in p.get("targets", {}).items() if verdict == "FAIL"]
        rb = p.get("ratios_to_busy") or {}
        rows.append((name, f"{ms(v['ttft_s']['p99'])} ({times(r['ttft_p99'], 2)})",
                     f"{ms(v['tbt_s']['p99'])} ({times(r['tbt_p99'], 2)})",
                     f"{times(rb.get('ttft_p99'), 2)} / {times(rb.get('tbt_p99'), 2)}"
                     if rb else DASH,
                     f"{num(h['p99'], 0)} / {num(h['max'], 0)}",
                     num(p["victim_until_settled"]["lost"]), num(p["server_errors"]),
                     ", ".join(f"{k}: {n}" for k, n in a["statuses"].items()) or DASH,
                     ", ".join(a["codes"]) or DASH, _lag(p.get("loop_lag")),
                     " ".join([p.get("verdict", "quiet"), *failed])))
    return [*settings_line({k: doc["settings"].get(k) for k in (
                "model", "redis", "window_s", "quotas", "attacker", "load_average")}),
            *table(("phase", "victim TTFT p99 ms (× baseline)", "victim TBT p99 ms (× baseline)",
                    "TTFT / TBT p99 × the busy phase's",
                    "/health p99 / max ms", "victim lost", "5xx", "attacker statuses",
                    "attacker refused with", "loop lag p99 / max ms", "verdict, failed targets"),
                   rows)]


def _lag(lag: dict | None) -> str:
    """The gateway's own event-loop lag over a phase (bucket bounds: "≤"), where it reports it;
    "> 10 s" past the largest bound."""
    if not lag or lag.get("wakeups") is None:
        return DASH

    def bound(le: float | None) -> str:
        return "> 10 s" if le is None else f"≤ {num(le * 1000, 0)}"
    return f"{bound(lag['p99_le_s'])} / {bound(lag['max_le_s'])}"


def sim(doc: Doc) -> list[str]:
    """`specgate sim --json`: per policy, latency and its split into waiting and time in steps."""
    rows = [(name, num(p["mean_latency_s"]), num(p.get("p50_latency_s")), num(p["p99_latency_s"], 1),
             num(p.get("max_wait_s"), 1), num(p.get("mean_wait_s")), num(p.get("mean_in_steps_s")),
             num(p.get("mean_batch")), num(p.get("committed_tokens_per_s"), 1))
            for name, p in doc["policies"].items()]
    out = [*settings_line(doc.get("settings", {})),
           *table(("policy", "mean s", "p50 s", "p99 s", "max wait s", "mean waiting s",
                   "mean in steps s", "mean batch", "committed tokens/s"), rows)]
    tiers = sorted({t for p in doc["policies"].values() for t in p.get("slo_attainment") or {}})
    if tiers:                                   # with --tiers: each tier's objectives met, goodput
        alone = sorted({t for p in doc["policies"].values() for t in p.get("slo_attainment_alone") or {}})
        out += ["", *table(("policy", *(f"{t} attainment" for t in tiers),
                            *(f"{t} alone" for t in alone), "goodput tokens/s"),
                           [(name, *(num(p["slo_attainment"].get(t), 3) for t in tiers),
                             *(num((p.get("slo_attainment_alone") or {}).get(t), 3) for t in alone),
                             num(p.get("goodput_tok_s"), 1))
                            for name, p in doc["policies"].items()])]
    return out


def scalars(doc: Doc) -> list[str]:
    """Any result without a table of its own: its top-level figures (settings in a line)."""
    rows = [(k, num(v, 3)) for k, v in doc.items()
            if k not in ("meta", "settings") and isinstance(v, (int, float, str, bool))]
    return [*settings_line(doc.get("settings", {})), *table(("figure", "value"), rows)]


def plan_policies(doc: Doc) -> list[str]:
    """`bench plan`: microseconds per decision, per policy."""
    return [f"{num(doc.get('requests'))} live requests.", "",
            *table(("policy", "plan median µs", "plan p99 µs", "update median µs"),
                   [(p["policy"], num(p["median_us"], 1), num(p["p99_us"], 1),
                     num(p["update_median_us"], 1)) for p in doc["policies"]])]
