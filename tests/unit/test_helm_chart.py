"""The Helm chart, checked with Helm's own Go SDK (helm-python-sdk; no helm binary): it lints and
renders for the default, GPU and external-Redis values; every rendered object parses and has what
Kubernetes requires; the Serve config it carries is a valid `RayAppConfig`; the values schema
refuses bad values; the chart's copies of the dashboards and rules are deploy/'s."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

helm = pytest.importorskip("helm_python")

from gateway.ray_serve.config import RayAppConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "specgate"
BASE = {"adminKey": "adm-test"}
GPU = {**BASE, "ray": {"gpuWorkers": {"enabled": True, "gpusPerWorker": 1,
                                      "nodeSelector": {"nvidia.com/gpu.present": "true"}}},
       "serve": {"verifierReplicas": 3}}
EXTERNAL = {**BASE, "redis": {"enabled": False, "externalUrl": "redis://redis.example:6379/2"},
            "tenants": {"tenants": {"acme": {"api_keys": ["sha256:" + "0" * 64]}}},
            "ingress": {"enabled": True, "host": "llm.example.com"}}
CASES = {"default": BASE, "gpu": GPU, "external-redis": EXTERNAL}


def render(values: dict) -> list[dict]:
    out = helm.Chart.load(CHART).render(values, name="sg", namespace="ml")
    docs = []
    for path, text in out.items():
        if path.endswith(".txt"):
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def pod_templates(doc: dict) -> list[dict]:
    if doc["kind"] == "RayService":
        cluster = doc["spec"]["rayClusterConfig"]
        return [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    if doc["kind"] in ("Deployment", "StatefulSet"):
        return [doc["spec"]["template"]]
    return []


@pytest.mark.parametrize("case", CASES)
def test_chart_lints_cleanly(case):
    report = helm.lint(CHART, CASES[case], strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("case", CASES)
def test_rendered_objects_carry_what_kubernetes_requires(case):
    docs = render(CASES[case])
    assert {"RayService", "Service", "Secret", "ServiceMonitor", "PrometheusRule", "ConfigMap"} <= {d["kind"] for d in docs}
    for d in docs:
        assert d["apiVersion"] and d["kind"], d
        name = d["metadata"]["name"]
        assert name and len(name) <= 63 and name == name.lower(), name
        claims = {c["metadata"]["name"] for c in d.get("spec", {}).get("volumeClaimTemplates", [])}
        for tpl in pod_templates(d):
            spec = tpl["spec"]
            assert spec["securityContext"]["runAsNonRoot"] is True
            for c in spec["containers"]:
                assert c["name"] and c["image"], c
                assert c["resources"]["requests"] and c["resources"]["limits"], c
                assert c["securityContext"]["allowPrivilegeEscalation"] is False
                assert c["securityContext"]["readOnlyRootFilesystem"] is True
                mounts = {m["name"] for m in c.get("volumeMounts", [])}
                assert mounts <= {v["name"] for v in spec.get("volumes", [])} | claims
        if d["kind"] == "StatefulSet":
            labels = d["spec"]["template"]["metadata"]["labels"]
            assert d["spec"]["selector"]["matchLabels"].items() <= labels.items()
    service = next(s for s in by_kind(docs, "Service") if s["metadata"]["name"] == "sg-specgate")
    head = by_kind(docs, "RayService")[0]["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]
    assert service["spec"]["selector"].items() <= head["metadata"]["labels"].items()
    probes = head["spec"]["containers"][0]
    assert probes["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert probes["livenessProbe"]["httpGet"]["path"] == "/health"


@pytest.mark.parametrize("case", CASES)
def test_the_serve_config_is_a_valid_application_config(case):
    svc = by_kind(render(CASES[case]), "RayService")[0]
    serve_cfg = yaml.safe_load(svc["spec"]["serveConfigV2"])
    (app,) = serve_cfg["applications"]
    assert app["import_path"] == "gateway.builders.ray_app:app_builder"
    cfg = RayAppConfig(**app["args"])
    assert cfg.verifier.num_gpus == (1 if case == "gpu" else 0)
    assert cfg.verifier.num_replicas == (3 if case == "gpu" else 2)
    assert cfg.ingress.graceful_shutdown_timeout_s >= 600      # drained, they let streams end
    assert cfg.scheduler.graceful_shutdown_timeout_s >= 600


def test_grpc_goes_through_serves_grpc_proxy_and_can_be_switched_off():
    from gateway.ray_serve.deployments import GRPC_SERVICER

    for values, port in ((BASE, 9000), ({**BASE, "service": {"grpcPort": 50051}}, 50051),
                         ({**BASE, "service": {"grpcPort": None}}, None)):
        docs = render(values)
        serve_cfg = yaml.safe_load(by_kind(docs, "RayService")[0]["spec"]["serveConfigV2"])
        service = next(s for s in by_kind(docs, "Service") if s["metadata"]["name"] == "sg-specgate")
        ports = {p["name"]: p for p in service["spec"]["ports"]}
        if port is None:
            assert "grpc_options" not in serve_cfg and set(ports) == {"http"}
        else:
            assert serve_cfg["grpc_options"] == {"port": 9000, "grpc_servicer_functions": [GRPC_SERVICER]}
            assert ports["grpc"]["port"] == port and ports["grpc"]["targetPort"] == 9000


def test_an_optional_grpc_ingress_routes_to_the_grpc_port():
    assert not [i for i in by_kind(render(BASE), "Ingress")]
    docs = render({**BASE, "ingress": {"enabled": True, "host": "api.example.com",
                                       "grpc": {"enabled": True, "host": "grpc.example.com"}}})
    ingresses = {i["metadata"]["name"]: i for i in by_kind(docs, "Ingress")}
    assert set(ingresses) == {"sg-specgate", "sg-specgate-grpc"}
    rule = ingresses["sg-specgate-grpc"]["spec"]["rules"][0]
    assert rule["host"] == "grpc.example.com"
    assert rule["http"]["paths"][0]["backend"]["service"]["port"] == {"name": "grpc"}
    assert ingresses["sg-specgate-grpc"]["metadata"]["annotations"] == {
        "nginx.ingress.kubernetes.io/backend-protocol": "GRPC"}
    with pytest.raises(helm.HelmError, match="needs service.grpcPort"):
        render({**BASE, "service": {"grpcPort": None}, "ingress": {"grpc": {"enabled": True}}})


def test_gpu_values_make_a_gpu_worker_group():
    groups = {g["groupName"]: g for g in by_kind(render(GPU), "RayService")[0]["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    assert set(groups) == {"cpu", "gpu"}
    pod = groups["gpu"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    assert set(groups_default := {g["groupName"] for g in by_kind(render(BASE), "RayService")[0]
                                  ["spec"]["rayClusterConfig"]["workerGroupSpecs"]}) == {"cpu"}, groups_default


def env_of(docs: list[dict]) -> dict[str, dict]:
    head = by_kind(docs, "RayService")[0]["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]
    return {e["name"]: e for e in head["spec"]["containers"][0]["env"]}


def test_redis_in_chart_or_external():
    docs = render(BASE)
    assert by_kind(docs, "StatefulSet")[0]["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "1Gi"
    assert env_of(docs)["SPECGATE_REDIS_URL"]["value"] == "redis://sg-specgate-redis:6379/0"
    docs = render(EXTERNAL)
    assert by_kind(docs, "StatefulSet") == []
    env = env_of(docs)
    assert env["SPECGATE_REDIS_URL"]["value"] == "redis://redis.example:6379/2"
    assert env["SPECGATE_TENANTS_FILE"]["value"] == "/etc/specgate/tenants.yaml"
    secret = by_kind(docs, "Secret")[0]["stringData"]
    assert yaml.safe_load(secret["tenants.yaml"]) == EXTERNAL["tenants"]
    assert by_kind(docs, "Ingress")[0]["spec"]["rules"][0]["host"] == "llm.example.com"


def test_monitoring_objects_carry_the_shipped_rules_and_dashboards():
    docs = render(BASE)
    rules = yaml.safe_load((ROOT / "deploy/prometheus/specgate-rules.yaml").read_text())
    assert by_kind(docs, "PrometheusRule")[0]["spec"]["groups"] == rules["groups"]
    maps = by_kind(docs, "ConfigMap")
    assert len(maps) == len(list((ROOT / "deploy/grafana").glob("*.json")))
    for m in maps:
        assert m["metadata"]["labels"]["grafana_dashboard"] == "1"
        ((name, body),) = m["data"].items()
        assert body.strip() == (ROOT / "deploy/grafana" / name).read_text().strip()
    endpoint = by_kind(docs, "ServiceMonitor")[0]["spec"]["endpoints"][0]
    assert endpoint["path"] == "/metrics" and endpoint["authorization"]["credentials"]["key"] == "admin-key"


@pytest.mark.parametrize("bad", [
    {"serve": {"verifierReplicas": 0}},
    {"service": {"port": "http"}},
    {"service": {"grpcPort": 70000}},
    {"redis": {"externalUrl": "http://not-redis"}},
    {"settings": {"policy": "random"}},
    {"ray": {"gpuWorkers": {"gpusPerWorker": 0}}},
    {"no_such_key": 1},
])
def test_the_values_schema_refuses_bad_values(bad):
    with pytest.raises(helm.HelmError):
        helm.Chart.load(CHART).validate_schema({**BASE, **bad})
    helm.Chart.load(CHART).validate_schema(BASE)          # and accepts good ones


def test_a_missing_admin_key_is_a_clear_render_error():
    with pytest.raises(helm.HelmError, match="adminKey is required"):
        helm.Chart.load(CHART).render({}, name="sg", namespace="ml")
