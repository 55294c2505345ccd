"""Dashboards and alert rules against the real tools: every metric they name is exposed by a
running gateway after a short load, the rules pass `promtool check rules`, and a real Prometheus
(on loopback) scraping that gateway answers every dashboard panel's query with data.

The gateway runs a tiny random model that speaks the default model's tokenizer, with Redis (so
the state-store health series exists) and a tenant limited to one request a minute (so refusals
exist)."""
from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.http.server import free_port
from gateway.settings import Settings
from redis_server import delete_prefix, unique_prefix
from tests.helpers import serving, tiny_model_dir

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
ADMIN = "adm-observability-test"
KEYS = {"acme": "sk-obs-acme", "zeta": "sk-obs-zeta", "limited": "sk-obs-limited"}
# Grafana's variables, as a person would first see them (build.py's defaults, all tenants)
VARS = {"$__rate_interval": "1m", "$tenant": ".*", "$slo_ttft_s": "2.5", "$slo_itl_s": "0.2",
        "$objective": "0.99"}


def load_build():
    spec = importlib.util.spec_from_file_location("dashboards_build", ROOT / "deploy/grafana/build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(dashboard, panel, expr with the variables filled in) for every panel target."""
    out = []
    for path in sorted((ROOT / "deploy/grafana").glob("*.json")):
        doc = json.loads(path.read_text())
        for panel in doc["panels"]:
            for target in panel["targets"]:
                expr = target["expr"]
                for var, value in VARS.items():
                    expr = expr.replace(var, value)
                assert "$" not in expr, (path.name, panel["title"], expr)
                out.append((path.name, panel["title"], expr))
    return out


def rule_exprs() -> list[str]:
    import yaml
    doc = yaml.safe_load((ROOT / "deploy/prometheus/specgate-rules.yaml").read_text())
    return [r["expr"] for g in doc["groups"] for r in g["rules"]]


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\bspecgate_[a-z_]+\b", expr))     # recording rules are "specgate:..."


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, redis_url):
    prefix = unique_prefix()
    model = tiny_model_dir(tmp_path_factory.mktemp("obs") / "tiny")
    try:
        with serving(Settings(model=str(model), redis_url=redis_url, store_prefix=prefix,
                              admin_key=ADMIN, max_batch=4, log_level="warning"),
                     {name: [key] for name, key in KEYS.items()},
                     tenant_options={"limited": {"rpm": 1}}) as (_, url):
            yield url, str(model)
    finally:
        delete_prefix(redis_url, prefix)


def short_load(url: str, model: str, rounds: int = 1) -> None:
    """Streams and plain requests from two tenants (repetitive prompts, so drafts are accepted),
    and a limited tenant's second request, refused."""
    with httpx.Client(base_url=url, timeout=60) as h:
        for r in range(rounds):
            for tenant in ("acme", "zeta"):
                for stream in (False, True):
                    body = {"model": model, "prompt": "a b c d a b c d a b c d " * 3, "max_tokens": 24,
                            "temperature": 0, "stream": stream}
                    resp = h.post("/v1/completions", json=body,
                                  headers={"Authorization": f"Bearer {KEYS[tenant]}"})
                    assert resp.status_code == 200, resp.text
            for _ in range(2):
                h.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2},
                       headers={"Authorization": f"Bearer {KEYS['limited']}"})


def scrape(url: str) -> str:
    r = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10)
    r.raise_for_status()
    return r.text


def test_dashboards_and_rules_are_what_build_py_writes():
    for path, text in load_build().render().items():
        assert path.read_text(encoding="utf-8") == text, f"{path} is stale: run deploy/grafana/build.py"


def test_every_metric_a_dashboard_or_rule_names_is_exposed(gateway):
    url, model = gateway
    short_load(url, model)
    exposed = {s.name for fam in text_string_to_metric_families(scrape(url)) for s in fam.samples}
    used = set().union(*(metric_names(e) for _, _, e in dashboard_queries()),
                       *(metric_names(e) for e in rule_exprs()))
    assert len(used) >= 15
    assert not used - exposed, sorted(used - exposed)


def test_prefix_cache_hits_are_counted_per_tenant(gateway):
    """short_load repeats one prompt per tenant: after the first, the verifier's prefix cache
    serves its whole blocks, and each tenant is counted apart."""
    url, model = gateway
    short_load(url, model)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(scrape(url)) for s in f.samples}
    for tenant in ("acme", "zeta"):
        hits = samples.get(("specgate_prefix_cache_hit_tokens_total", (("tenant", tenant),)), 0)
        prefilled = samples[("specgate_prefill_tokens_total", (("tenant", tenant),))]
        assert 32 <= hits < prefilled
    held = samples[("specgate_prefix_cache_bytes", ())]
    capacity = samples[("specgate_prefix_cache_capacity_bytes", ())]
    assert 0 < held <= capacity


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian package prometheus) not installed")
def test_rules_pass_promtool():
    out = subprocess.run(["promtool", "check", "rules", str(ROOT / "deploy/prometheus/specgate-rules.yaml")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout



@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus (Debian package) not installed")
def test_a_real_prometheus_answers_every_panel_query_with_data(gateway, tmp_path):
    url, model = gateway
    port = free_port()
    target = url.removeprefix("http://")
    config = tmp_path / "prometheus.yml"
    config.write_text(f"""
global: {{scrape_interval: 1s, evaluation_interval: 1s}}
rule_files: ["{ROOT / 'deploy/prometheus/specgate-rules.yaml'}"]
scrape_configs:
  - job_name: specgate
    metrics_path: /metrics
    authorization: {{type: Bearer, credentials: {ADMIN}}}
    static_configs: [{{targets: ["{target}"]}}]
""")
    proc = subprocess.Popen(["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    api = f"http://127.0.0.1:{port}/api/v1"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:              # Prometheus up and scraping the gateway
            try:        # while starting, Prometheus answers 503 in plain text
                r = httpx.get(f"{api}/query", params={"query": 'up{job="specgate"}'}, timeout=2)
                up = r.json() if r.status_code == 200 else {"data": {"result": []}}
                if up["data"]["result"] and up["data"]["result"][0]["value"][1] == "1":
                    break
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.2)
        else:
            pytest.fail("Prometheus did not scrape the gateway: " + proc.stderr.read1(4000).decode())
        for _ in range(3):                               # load across several scrapes: rates exist
            short_load(url, model)
            time.sleep(1.2)
        empty = []
        for dash, panel, expr in dashboard_queries():
            doc = httpx.get(f"{api}/query", params={"query": expr}, timeout=10).json()
            assert doc["status"] == "success", (dash, panel, expr, doc)
            if not doc["data"]["result"]:
                empty.append((dash, panel, expr))
        assert not empty, empty
        rules = httpx.get(f"{api}/rules", timeout=10).json()["data"]["groups"]
        assert sum(len(g["rules"]) for g in rules) == len(rule_exprs())     # every rule loaded
        assert all(r["health"] != "err" for g in rules for r in g["rules"])
    finally:
        proc.terminate()
        proc.wait(10)
