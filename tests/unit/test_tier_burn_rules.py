"""The per-tier burn-rate alerts (deploy/prometheus/specgate-rules.yaml, written by
deploy/grafana/build.py) under `promtool test rules`: three tiers miss their objectives at known
rates, each against the budget its gateways export (`specgate_slo_objective`), and exactly the
alerts the SRE workbook's windows call for fire, labelled by tier and objective."""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy/prometheus/specgate-rules.yaml"

pytestmark = pytest.mark.skipif(shutil.which("promtool") is None,
                                reason="promtool (Debian package prometheus) not installed")


def build():
    spec = importlib.util.spec_from_file_location("dashboards_build", ROOT / "deploy/grafana/build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# tier -> (objective share its gateways export, share of its ttft checks missed, checks a minute)
LOAD = {"priority": (0.99, 0.20, 100),    # 20x its 1 % budget: pages and tickets
        "default": (0.99, 0.10, 100),     # 10x: past the 6h/30m windows' 6x only
        "flex": (0.95, 0.10, 100)}        # 2x its 5 % budget (it would page at 1 %): neither


def series() -> list[dict]:
    out = []
    for tier, (objective, missed, per_min) in LOAD.items():
        miss = round(per_min * missed)
        for result, step in (("missed", miss), ("met", per_min - miss)):
            out.append({"series": (f'specgate_slo_requests_total{{tenant="acme", tier="{tier}", '
                                   f'objective="ttft", result="{result}", instance="gw-0"}}'),
                        "values": f"0+{step}x420"})
        for objective_name in ("ttft", "tbt"):
            out.append({"series": (f'specgate_slo_objective{{tier="{tier}", objective='
                                   f'"{objective_name}", instance="gw-0"}}'),
                        "values": f"{objective}x420"})
    return out


def alert(name: str, tier: str, severity: str, factor: float, long: str, short: str) -> dict:
    return {"exp_labels": {"severity": severity, "tier": tier, "objective": "ttft"},
            "exp_annotations": {"summary": build().tier_summary(factor, long, short)
                                .replace("{{ $labels.tier }}", tier)
                                .replace("{{ $labels.objective }}", "ttft")}}


def run_promtool(tmp_path: Path, tests: list[dict]) -> subprocess.CompletedProcess:
    doc = {"rule_files": [str(RULES)], "evaluation_interval": "1m", "tests": tests}
    path = tmp_path / "tier_rules_test.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True, text=True,
                          timeout=120)


def test_each_tier_burns_its_own_budget_and_pages_or_tickets_as_the_windows_say(tmp_path):
    page = ("SpecgateTierBudgetBurn1h", "page", 14.4, "1h", "5m")
    ticket = ("SpecgateTierBudgetBurn6h", "ticket", 6.0, "6h", "30m")
    tests = [{"interval": "1m", "input_series": series(), "alert_rule_test": [
        {"eval_time": "7h", "alertname": page[0], "exp_alerts": [alert(page[0], "priority", *page[1:])]},
        {"eval_time": "7h", "alertname": ticket[0],
         "exp_alerts": [alert(ticket[0], t, *ticket[1:]) for t in ("default", "priority")]},
    ], "promql_expr_test": [
        {"expr": 'round(specgate:tier_slo_budget:ratio{tier="flex", objective="ttft"}, 0.0001)',
         "eval_time": "1h", "exp_samples": [{"labels": '{tier="flex", objective="ttft"}',
                                             "value": 0.05}]},
        {"expr": 'round(specgate:tier_slo_miss:ratio_rate1h{tier="default"}, 0.0001)',
         "eval_time": "2h", "exp_samples": [{"labels": '{tier="default", objective="ttft"}',
                                             "value": 0.1}]},
    ]}]
    out = run_promtool(tmp_path, tests)
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_tier_within_its_budget_does_not_alert(tmp_path):
    """The check above can fail: flex expected to page at 2x its own budget is refused."""
    tests = [{"interval": "1m", "input_series": series(), "alert_rule_test": [
        {"eval_time": "7h", "alertname": "SpecgateTierBudgetBurn1h",
         "exp_alerts": [alert("SpecgateTierBudgetBurn1h", t, "page", 14.4, "1h", "5m")
                        for t in ("flex", "priority")]}]}]
    out = run_promtool(tmp_path, tests)
    assert out.returncode != 0 and "flex" in out.stdout + out.stderr
