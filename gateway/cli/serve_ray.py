"""`specgate serve --ray [--config FILE]`: the Ray Serve application on a local Ray cluster.

    specgate serve --ray --redis-url redis://127.0.0.1:6379/0           # defaults, flags apply
    specgate serve --ray --config deploy/serve/specgate.yaml            # a Serve config file

A config file is a Serve config (`applications[0].args` is a `gateway.ray_serve.config.RayAppConfig`, its
`http_options` the listening address, its `grpc_options` Serve's gRPC proxy); flags given on the
command line override its settings. `--grpc-port` (setting `grpc_port`) serves gRPC on that port.
On a cluster that is already running, deploy the same file with Ray's own `serve deploy FILE`.

Secrets (`SPECGATE_ADMIN_KEY`, `SPECGATE_METRICS_KEY`, `SPECGATE_KEY_PEPPER`, a Redis URL with a
password) never go in the Serve config: the local cluster's processes inherit them from this
one's environment, where the replicas read them (`gateway.ray_serve.replica_secrets`).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import ray
import yaml
from ray import serve

from gateway.builders.ray_app import build_ray_app
from gateway.ray_serve.config import RayAppConfig
from gateway.ray_serve.ingress import GRPC_SERVICER
from gateway.ray_serve.replica_secrets import export_secrets, refuse_secrets
from gateway.settings import Settings
from gateway.tenancy.tenants import TenantRegistry

APP_NAME = "specgate"
RAY_GRPC_MAX_MESSAGE = "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"     # Serve's proxy's cap, in bytes


def load_config(path: Path | None, overrides: dict[str, Any]) -> tuple[RayAppConfig, dict[str, Any]]:
    """(the application's config, Serve's http_options) from a Serve config file and flags.
    ValueError if either holds a secret: those reach the replicas through the environment."""
    http: dict[str, Any] = {}
    args: dict[str, Any] = {}
    if path is not None:
        doc = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
        apps = doc.get("applications") or []
        if len(apps) != 1:
            raise ValueError(f"{path}: expected one application, found {len(apps)}")
        args = apps[0].get("args") or {}
        http = dict(doc.get("http_options") or {})
        refuse_secrets(args.get("settings") or {}, f"{path}: settings")
    refuse_secrets(overrides)
    cfg = RayAppConfig(**args)
    cfg.settings.update(overrides)
    s = cfg.gateway_settings()                     # validates, and needs a Redis URL
    if "host" in overrides or "host" not in http:
        http["host"] = s.host
    if "port" in overrides or "port" not in http:
        http["port"] = s.port
    return cfg, http


def load_grpc_options(path: Path | None, cfg: RayAppConfig) -> dict[str, Any] | None:
    """Serve's `grpc_options`: the config file's, its port replaced by the `grpc_port` setting when
    that is set; always naming specgate's servicer. None: no gRPC."""
    grpc: dict[str, Any] = {}
    if path is not None:
        grpc = dict((yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}).get("grpc_options") or {})
    port = cfg.gateway_settings().grpc_port
    if port is not None:
        grpc["port"] = port
    if not grpc:
        return None
    grpc["grpc_servicer_functions"] = sorted({*grpc.get("grpc_servicer_functions", ()), GRPC_SERVICER})
    return grpc


def run(args: Any, overrides: dict[str, Any]) -> int:
    try:
        # the Redis URL's password (a flag's) to the environment the local cluster inherits
        public = export_secrets(overrides)
        cfg, http = load_config(getattr(args, "config", None), public)
        grpc = load_grpc_options(getattr(args, "config", None), cfg)
    except (ValueError, OSError) as e:
        print(f"specgate serve --ray: {e}", file=sys.stderr)
        return 2
    settings: Settings = cfg.gateway_settings()
    try:
        # as the replicas open it: with the file's admin keys alone, this start and the replicas'
        # would each replace the stored admin keys, and bring back a revoked one
        tenants = TenantRegistry.from_settings(settings)
    except ValueError as e:
        print(f"specgate serve --ray: {e}", file=sys.stderr)
        return 2
    dev_key = tenants.ensure_dev_tenant()
    # Serve's gRPC proxy takes no message-size option (`gRPCOptions`), only this variable, read
    # where the proxy starts: the local cluster's processes inherit it from here. A REST body and
    # a gRPC message get one cap (the ingress refuses a larger one too: gateway/grpc_api/messages.py).
    os.environ[RAY_GRPC_MAX_MESSAGE] = str(settings.max_body_bytes)
    ray.init(include_dashboard=False, logging_level="warning")
    try:
        serve.start(http_options=http, grpc_options=grpc)
        serve.run(build_ray_app(cfg), name=APP_NAME, route_prefix=cfg.route_prefix)
        if dev_key:
            print(f"specgate: dev tenant API key: {dev_key}", file=sys.stderr)
        print(f"specgate: Ray Serve app {APP_NAME!r} serving {settings.model_id} on "
              f"http://{http['host']}:{http['port']}"
              + (f" and gRPC port {grpc['port']}" if grpc else "") + " (Ctrl-C stops it)", file=sys.stderr)
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        try:
            stop.wait()
        except KeyboardInterrupt:
            pass
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
