"""Build specgate's Grafana dashboards and Prometheus alert rules from one place.

    python deploy/grafana/build.py   # rewrites deploy/grafana/*.json, deploy/prometheus/*.yaml and
                                     # their copies in deploy/helm/specgate/files/

Why generated: four dashboards and the rules share every query's shape (tenant filter, rate
window, SLO thresholds); written once here, they cannot drift apart, and the tests
(tests/unit/deploy/) check every query against the metrics a running gateway exposes and against
a real Prometheus. The files are committed, so Grafana's sidecar and Helm read them as they are.

Template variables every dashboard has: `datasource`, `tenant` (multi, regex), `slo_ttft_s` and
`slo_itl_s` (SLO thresholds: they must be histogram bucket bounds, so they are lists of the
buckets gateway/metrics.py declares), `objective` (the SLO target, e.g. 0.99).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
RULES = HERE.parent / "prometheus" / "specgate-rules.yaml"
CHART_FILES = HERE.parent / "helm" / "specgate" / "files"
RATE = "$__rate_interval"
T = 'tenant=~"$tenant"'

# Bounds from gateway/metrics.py (LATENCY_BUCKETS, TOKEN_LATENCY_BUCKETS) usable as SLO lines.
TTFT_SLOS = ("0.5", "1.0", "2.5", "5.0")
ITL_SLOS = ("0.05", "0.1", "0.2", "0.3", "0.5")
DEFAULT_TTFT_SLO, DEFAULT_ITL_SLO, DEFAULT_OBJECTIVE = "2.5", "0.2", "0.99"


def q(expr: str, legend: str = "") -> dict:
    return {"expr": expr, "legend": legend}


def quantiles(metric: str, by: str = "") -> list[dict]:
    group = f"le{', ' + by if by else ''}"
    label = f"{{{{{by}}}}} " if by else ""
    return [q(f"histogram_quantile({p}, sum by ({group}) (rate({metric}_bucket{{{T}}}[{RATE}])))",
              f"{label}p{int(p * 100)}") for p in (0.5, 0.95, 0.99)]


def slo_attainment(metric: str, var: str) -> str:
    """Fraction of observations at or under the SLO bound (a bucket's `le`)."""
    return (f'sum(rate({metric}_bucket{{{T}, le="${var}"}}[{RATE}])) / '
            f"sum(rate({metric}_count{{{T}}}[{RATE}]))")


def ratio_by(label: str, num: str, den: str) -> dict:
    """Per `label`: rate(num) ÷ rate(den), e.g. accepted ÷ drafted tokens = α."""
    return q(f"sum by ({label}) (rate({num}{{{T}}}[{RATE}])) / "
             f"sum by ({label}) (rate({den}{{{T}}}[{RATE}]))", f"{{{{{label}}}}}")


ERRORS = f'sum(rate(specgate_requests_total{{{T}, status="failed"}}[{RATE}]))'

# service tiers (gateway/tiers.py): each request counted once per objective of its tier, met or
# missed; each tier's target share is exported (`specgate_slo_objective`), so the budget a burn
# rate divides by follows the deployment's tiers
SLO = "specgate_slo_requests_total"


def tier_attainment(by: str) -> str:
    return (f'sum by ({by}) (rate({SLO}{{{T}, result="met"}}[{RATE}])) / '
            f"sum by ({by}) (rate({SLO}{{{T}}}[{RATE}]))")


TIER_BURN = (f'(1 - {tier_attainment("tier, objective")}) / on (tier, objective) '
             "(1 - max by (tier, objective) (specgate_slo_objective))")
ALL_REQUESTS = f"sum(rate(specgate_requests_total{{{T}}}[{RATE}]))"

DASHBOARDS = {
    "slo": ("specgate: SLO overview", [
        ("Time to first token", "s", quantiles("specgate_time_to_first_token_seconds")
         + [q("vector($slo_ttft_s)", "SLO")]),
        ("Inter-token latency", "s", quantiles("specgate_inter_token_latency_seconds")
         + [q("vector($slo_itl_s)", "SLO")]),
        ("SLO attainment", "percentunit", [
            q(slo_attainment("specgate_time_to_first_token_seconds", "slo_ttft_s"), "TTFT"),
            q(slo_attainment("specgate_inter_token_latency_seconds", "slo_itl_s"), "inter-token")]),
        ("Error budget burn rate (1 = spending exactly the budget)", "none", [
            q(f"(1 - {slo_attainment('specgate_time_to_first_token_seconds', 'slo_ttft_s')}) "
              "/ (1 - $objective)", "TTFT"),
            q(f"(1 - {slo_attainment('specgate_inter_token_latency_seconds', 'slo_itl_s')}) "
              "/ (1 - $objective)", "inter-token"),
            q(f"({ERRORS} or vector(0)) / {ALL_REQUESTS} / (1 - $objective)", "errors")]),
        ("SLO attainment by service tier and tenant", "percentunit", [
            q(tier_attainment("tier, tenant, objective"), "{{tier}} {{tenant}} {{objective}}")]),
        ("Error budget burn rate by service tier (its own objective)", "none", [
            q(TIER_BURN, "{{tier}} {{objective}}")]),
        ("End-to-end latency", "s", quantiles("specgate_e2e_request_latency_seconds")),
        ("Requests by outcome", "reqps", [
            q(f"sum by (status) (rate(specgate_requests_total{{{T}}}[{RATE}]))", "{{status}}")]),
    ]),
    "speculation": ("specgate: speculation", [
        ("Acceptance rate α by tenant", "percentunit",
         [ratio_by("tenant", "specgate_accepted_tokens_total", "specgate_drafted_tokens_total")]),
        ("Acceptance rate α by drafter", "percentunit",
         [ratio_by("drafter", "specgate_accepted_tokens_total", "specgate_drafted_tokens_total")]),
        ("τ (tokens committed per step) by tenant", "none",
         [ratio_by("tenant", "specgate_tau_sum", "specgate_tau_count")]),
        ("τ by drafter", "none", [ratio_by("drafter", "specgate_tau_sum", "specgate_tau_count")]),
        ("Tree size (draft nodes per request and step)", "none", [
            q(f"sum(rate(specgate_drafted_tokens_total{{{T}}}[{RATE}])) / "
              f"sum(rate(specgate_tau_count{{{T}}}[{RATE}]))", "nodes")]),
        ("Drafted vs accepted tokens", "short", [
            q(f"sum(rate(specgate_drafted_tokens_total{{{T}}}[{RATE}]))", "drafted"),
            q(f"sum(rate(specgate_accepted_tokens_total{{{T}}}[{RATE}]))", "accepted")]),
    ]),
    "scheduler": ("specgate: scheduler", [
        ("Queue depth by level", "short", [
            q('sum by (level) (specgate_queue_depth{status="queued"})', "level {{level}}")]),
        ("Live requests by status", "short", [q("sum by (status) (specgate_queue_depth)", "{{status}}")]),
        ("Perceptible requests (stable acceptance, ranked by predicted time)", "short", [
            q("sum(specgate_perceptible_requests)", "perceptible")]),
        ("Preemptions", "ops", [q(f"sum(rate(specgate_preemptions_total[{RATE}]))", "preempted")]),
        ("Fairness: share of verifier work per tenant", "percentunit", [
            q(f"sum by (tenant) (rate(specgate_verified_tokens_total{{{T}}}[{RATE}])) / ignoring (tenant) "
              f"group_left sum(rate(specgate_verified_tokens_total[{RATE}]))", "{{tenant}}")]),
        ("Batch size", "short", [
            q(f"sum(rate(specgate_batch_size_sum[{RATE}])) / sum(rate(specgate_batch_size_count[{RATE}]))",
              "mean"),
            q(f"histogram_quantile(0.99, sum by (le) (rate(specgate_batch_size_bucket[{RATE}])))", "p99")]),
        ("Step time", "s", [
            q(f"histogram_quantile({p}, sum by (le) (rate(specgate_step_duration_seconds_bucket[{RATE}])))",
              f"p{int(p * 100)}") for p in (0.5, 0.99)]),
        ("Queue time", "s", quantiles("specgate_queue_time_seconds")),
        ("Prefix cache: fill (KV bytes held / capacity)", "percentunit", [
            q("sum(specgate_prefix_cache_bytes) / sum(specgate_prefix_cache_capacity_bytes)",
              "fill")]),
    ]),
    "tenants": ("specgate: tenants", [
        ("Requests by tenant", "reqps", [
            q(f"sum by (tenant) (rate(specgate_requests_total{{{T}}}[{RATE}]))", "{{tenant}}")]),
        ("Output tokens by tenant", "short", [
            q(f"sum by (tenant) (rate(specgate_generation_tokens_total{{{T}}}[{RATE}]))", "{{tenant}}")]),
        ("Prompt tokens by tenant", "short", [
            q(f"sum by (tenant) (rate(specgate_prompt_tokens_total{{{T}}}[{RATE}]))", "{{tenant}}")]),
        ("Prefix cache: share of prefilled tokens served from it", "percentunit",
         [ratio_by("tenant", "specgate_prefix_cache_hit_tokens_total", "specgate_prefill_tokens_total")]),
        ("Rate-limit refusals", "reqps", [
            q(f"sum by (tenant, reason) (rate(specgate_rate_limit_refusals_total{{{T}}}[{RATE}]))",
              "{{tenant}} {{reason}}")]),
    ]),
}


def dashboard(key: str, title: str, panels: list) -> dict:
    out = []
    for i, (name, unit, queries) in enumerate(panels):
        out.append({
            "id": i + 1, "type": "timeseries", "title": name,
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [{"refId": chr(65 + j), "expr": t["expr"], "legendFormat": t["legend"],
                         "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                        for j, t in enumerate(queries)],
        })
    return {
        "uid": f"specgate-{key}", "title": title, "tags": ["specgate"], "editable": True,
        "schemaVersion": 39, "version": 1, "refresh": "30s", "timezone": "browser",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Data source"},
            {"name": "tenant", "type": "query", "label": "Tenant", "multi": True, "includeAll": True,
             "allValue": ".*", "datasource": {"type": "prometheus", "uid": "${datasource}"},
             "query": {"query": "label_values(specgate_requests_total, tenant)", "refId": "tenants"},
             "refresh": 2},
            _custom("slo_ttft_s", "TTFT SLO (s)", TTFT_SLOS, DEFAULT_TTFT_SLO),
            _custom("slo_itl_s", "Inter-token SLO (s)", ITL_SLOS, DEFAULT_ITL_SLO),
            _custom("objective", "SLO objective", ("0.9", "0.95", "0.99", "0.995", "0.999"), DEFAULT_OBJECTIVE),
        ]},
        "panels": out,
    }


def _custom(name: str, label: str, values: tuple[str, ...], default: str) -> dict:
    return {"name": name, "type": "custom", "label": label, "query": ",".join(values),
            "current": {"text": default, "value": default},
            "options": [{"text": v, "value": v, "selected": v == default} for v in values]}


# ---- alert rules: multi-window burn rates (the SRE workbook's 1h/5m at 14.4x, 6h/30m at 6x) ------
WINDOWS = ("5m", "30m", "1h", "6h")
BURN = (("1h", "5m", 14.4, "page"), ("6h", "30m", 6.0, "ticket"))


def sli_miss(metric: str, le: str, w: str) -> str:
    return (f'1 - (sum(rate({metric}_bucket{{le="{le}"}}[{w}])) / sum(rate({metric}_count[{w}])))')


def tier_rules() -> tuple[list[dict], list[dict]]:
    """Per service tier and objective: the share of requests missing it over each window, the
    tier's error budget (1 − its objective, as the gateways export it), and the SRE workbook's
    multi-window burn-rate alerts on that budget, one series per tier and objective."""
    recording = [{"record": f"specgate:tier_slo_miss:ratio_rate{w}",
                  "expr": (f'sum by (tier, objective) (rate({SLO}{{result="missed"}}[{w}])) / '
                           f"sum by (tier, objective) (rate({SLO}[{w}]))")} for w in WINDOWS]
    recording.append({"record": "specgate:tier_slo_budget:ratio",
                      "expr": "1 - max by (tier, objective) (specgate_slo_objective)"})
    alerts = []
    for long, short, factor, severity in BURN:
        burn = [f"specgate:tier_slo_miss:ratio_rate{w} > on (tier, objective) "
                f"{factor} * specgate:tier_slo_budget:ratio" for w in (long, short)]
        alerts.append({
            "alert": f"SpecgateTierBudgetBurn{long}", "expr": " and ".join(burn),
            "labels": {"severity": severity},
            "annotations": {"summary": tier_summary(factor, long, short)}})
    return recording, alerts


def tier_summary(factor: float, long: str, short: str) -> str:
    return (f"the {{{{ $labels.tier }}}} tier is burning its {{{{ $labels.objective }}}} error "
            f"budget {factor}x too fast ({long} and {short} windows)")


def rules() -> dict:
    slis = {
        "ttft": lambda w: sli_miss("specgate_time_to_first_token_seconds", DEFAULT_TTFT_SLO, w),
        "itl": lambda w: sli_miss("specgate_inter_token_latency_seconds", DEFAULT_ITL_SLO, w),
        "errors": lambda w: (f'(sum(rate(specgate_requests_total{{status="failed"}}[{w}])) or vector(0)) / '
                             f"sum(rate(specgate_requests_total[{w}]))"),
    }
    budget = 1 - float(DEFAULT_OBJECTIVE)
    recording = [{"record": f"specgate:{name}_slo_miss:ratio_rate{w}", "expr": fn(w)}
                 for name, fn in slis.items() for w in WINDOWS]
    what = {"ttft": f"time to first token above {DEFAULT_TTFT_SLO}s",
            "itl": f"inter-token latency above {DEFAULT_ITL_SLO}s", "errors": "failed requests"}
    alerts = []
    for name in slis:
        for long, short, factor, severity in BURN:
            alerts.append({
                "alert": f"Specgate{name.upper() if name != 'errors' else 'Error'}BudgetBurn{long}",
                "expr": (f"specgate:{name}_slo_miss:ratio_rate{long} > {factor} * {budget:g} and "
                         f"specgate:{name}_slo_miss:ratio_rate{short} > {factor} * {budget:g}"),
                "labels": {"severity": severity},
                "annotations": {"summary": f"specgate is burning its {what[name]} error budget "
                                           f"{factor}x too fast ({long} and {short} windows)"}})
    tier_recording, tier_alerts = tier_rules()
    recording += tier_recording
    alerts += tier_alerts
    alerts += [
        {"alert": "SpecgateQueueSaturated",
         "expr": ('histogram_quantile(0.9, sum by (le) (rate(specgate_queue_time_seconds_bucket[10m]))) > 10 '
                  'and sum(specgate_queue_depth{status="queued"}) > 0'),
         "for": "10m", "labels": {"severity": "page"},
         "annotations": {"summary": "requests wait over 10 s (p90) for their first step: add verifier capacity"}},
        {"alert": "SpecgateStateStoreDown", "expr": 'specgate_component_up{component="state_store"} == 0',
         "for": "1m", "labels": {"severity": "page"},
         "annotations": {"summary": "Redis (the state store) does not answer: new requests get 503"}},
        {"alert": "SpecgateVerifierDown", "expr": 'specgate_component_up{component="step_loop"} == 0',
         "for": "1m", "labels": {"severity": "page"},
         "annotations": {"summary": "the step loop (verifier) of {{ $labels.instance }} has stopped"}},
        {"alert": "SpecgateGatewayDown", "expr": 'up{job="specgate"} == 0', "for": "2m",
         "labels": {"severity": "page"},
         "annotations": {"summary": "Prometheus cannot scrape {{ $labels.instance }}"}},
    ]
    return {"groups": [{"name": "specgate-slo-recording", "interval": "30s", "rules": recording},
                       {"name": "specgate-alerts", "rules": alerts}]}


def render() -> dict[Path, str]:
    """File path -> exact contents."""
    out = {HERE / f"specgate-{key}.json": json.dumps(dashboard(key, title, panels), indent=1) + "\n"
           for key, (title, panels) in DASHBOARDS.items()}
    out[RULES] = ("# Generated by deploy/grafana/build.py: edit that, then run it.\n"
                  + yaml.safe_dump(rules(), sort_keys=False, width=120))
    # The Helm chart ships the same files (a chart can only read files inside itself).
    for path, text in list(out.items()):
        out[CHART_FILES / path.name] = text
    return out


if __name__ == "__main__":
    for path, text in render().items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(path.relative_to(HERE.parent.parent), file=sys.stderr)
