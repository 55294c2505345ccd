"""`specgate serve`: the embedded gateway, one process: HTTP (and gRPC) front, scheduler, model.

    specgate serve                                   # the default model, state in memory
    specgate serve --redis-url redis://localhost:6379/0 --tenants tenants.yaml --grpc-port 50051

Start-up, in order: settings (flags over `SPECGATE_*` over defaults) → the target model (or the
fake worker) → policy, state store, step loop, tenants, limiter, service, app → recovery of the
requests the store still holds → the loop's thread → uvicorn (and gRPC) on one event loop.
`gateway.builders.embedded.build_embedded` does everything but listen, so tests assemble the same
app; this module parses the flags and listens.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

import uvicorn

from gateway.assembly.serving import Embedded
from gateway.assembly.target import freeze_heap
from gateway.builders.embedded import build_embedded
from gateway.grpc_api.server import GrpcServer, start_grpc_server
from gateway.http.server import run_on, uvicorn_config
from gateway.settings import Settings
from workers.model.placement import add_placement_arguments

log = logging.getLogger("specgate.serve")

# flag → settings field; flags left out keep the environment's value or the default
_FLAGS = ("host", "port", "model", "served_model_name", "tenants_file", "redis_url", "policy", "drafters", "grpc_port",
          "dtype", "device", "max_batch", "prefill_chunk_tokens", "kv_cache_mb", "step_profile", "log_level",
          "fake_worker", "fake_step_ms")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="HTTP port (default 8000)")
    p.add_argument("--model", help="built-in name, HF model directory or .gguf file "
                                   "(default smollm2-135m)")
    p.add_argument("--served-model-name", help="the model id clients send and /v1/models lists "
                   "(default: --model; set it when --model is a path)")
    p.add_argument("--tenants", dest="tenants_file", help="tenants YAML file (default: one 'dev' "
                   "tenant whose key is printed at start-up)")
    p.add_argument("--redis-url", help="Redis for scheduler state, tenants and rate limits "
                                       "(default: in process memory)")
    p.add_argument("--policy", choices=["laps", "fcfs", "sjf", "las", "priority"],
                   help="scheduling policy; priority: service tiers in strict order, first come "
                   "first served in each (default laps)")
    p.add_argument("--drafters", help="comma-separated drafter names; the first is the default "
                                      "(default ngram)")
    p.add_argument("--grpc-port", type=int, help="also serve gRPC on this port")
    add_placement_arguments(p, device=None, dtype=None)    # the settings' defaults: float32, auto
    p.add_argument("--max-batch", type=int, help="requests per verification step (default 8)")
    p.add_argument("--prefill-chunk-tokens", type=int, help="prompt tokens a step may prefill, per "
                   "request waiting for its context, beside the running requests' trees, so a "
                   "long prompt does not stall them; 0: each "
                   "prompt prefilled whole, alone (default 24)")
    p.add_argument("--kv-cache-mb", type=float, help="KV memory of the resident requests and the "
                   "prefix cache together; past it requests wait or are preempted (default: half "
                   "the memory available after the model loads, printed at start)")
    p.add_argument("--step-profile", help="step-cost profile JSON for the planner (`specgate bench "
                   "profile --json`; default: measured at start-up)")
    p.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"])
    # testing and gateway benchmarks: the scheduler's fake worker and a stand-in tokenizer
    p.add_argument("--ray", action="store_true", help="run as a Ray Serve application on a local Ray "
                   "cluster (ingress, scheduler and verifier deployments; needs a Redis URL)")
    p.add_argument("--config", type=Path, help="with --ray: a Serve config file "
                   "(e.g. deploy/serve/specgate.yaml); flags override its settings")
    p.add_argument("--fake-worker", action="store_true", default=None, help=argparse.SUPPRESS)
    p.add_argument("--fake-step-ms", type=float, help=argparse.SUPPRESS)


def settings_from_args(args: argparse.Namespace) -> Settings:
    given = {k: getattr(args, k) for k in _FLAGS if getattr(args, k, None) is not None}
    return Settings(**given)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "ray", False):
        # Ray (and what the Ray builder imports) only for --ray: the embedded gateway starts without
        from gateway.cli import serve_ray as ray_cmd
        given = {k: getattr(args, k) for k in _FLAGS if getattr(args, k, None) is not None}
        return ray_cmd.run(args, {k: str(v) if isinstance(v, Path) else v for k, v in given.items()})
    settings = settings_from_args(args)
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    emb = build_embedded(settings)
    freeze_heap()
    if emb.recovered:
        log.info("recovered %d request(s) from the state store", len(emb.recovered))
    if emb.dev_key:
        print(f"specgate: dev tenant API key: {emb.dev_key}", file=sys.stderr)
    if emb.admin_key:
        print(f"specgate: admin key (/metrics, /admin): {emb.admin_key}", file=sys.stderr)
    if emb.kv_note:
        print(f"specgate: {emb.kv_note}", file=sys.stderr)
    if emb.kernel_note:
        print(f"specgate: {emb.kernel_note}", file=sys.stderr)
    config = uvicorn_config(emb.app, host=settings.host, port=settings.port,
                            log_level=settings.log_level, send_buffer_bytes=settings.send_buffer_bytes)
    emb.start()
    try:
        run_on(config.get_loop_factory(), _serve(emb, uvicorn.Server(config)))
    finally:
        emb.stop()
    return 0


async def _serve(emb: Embedded, server: Any) -> None:
    s = emb.settings
    grpc = await start_grpc(emb) if s.grpc_port is not None else None
    print(f"specgate: serving {s.model_id} on http://{s.host}:{s.port}"
          + (f" and gRPC {s.host}:{grpc.port}" if grpc else "")
          + f" (policy {s.policy}, drafters {s.drafters})", file=sys.stderr)
    try:
        await server.serve()
    finally:
        if grpc is not None:
            await grpc.stop()


async def start_grpc(emb: Embedded) -> GrpcServer:
    """The gRPC front on `grpc_port` (unset: a free port), over the HTTP front's service,
    tenants and state, with its body cap: a message larger than `max_body_bytes` is refused as a
    REST body is, and its early refusals: a key refused on one front is refused early on both."""
    s = emb.settings
    return await start_grpc_server(emb.service, emb.tenants, emb.limiter, s.grpc_port or 0,
                                   host=s.host, replayer=emb.replayer,
                                   max_message_bytes=s.max_body_bytes,
                                   keepalive_s=s.stream_keepalive_s, followers=emb.followers,
                                   early=emb.app.state.early_refusals)
