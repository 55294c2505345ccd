"""`specgate serve`: the embedded gateway, one process: HTTP (and gRPC) front, scheduler, model.

    specgate serve                                   # the default model, state in memory
    specgate serve --redis-url redis://localhost:6379/0 --tenants tenants.yaml --grpc-port 50051

Start-up, in order: settings (flags over `SPECGATE_*` over defaults) → the target model (or the
fake worker) → policy, state store, step loop → recovery of the requests the store still holds →
tenants, limiter, service, app → the loop's thread → uvicorn (and gRPC) on one event loop.
`build_embedded` does everything but listen, so tests assemble the same app.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from gateway.app import build_app
from gateway.metrics import GatewayMetrics
from gateway.service import GenerationService
from gateway.settings import Settings
from gateway.text import ToyTokenizer
from scheduler.admission import AdmissionControl, AdmissionLimits
from scheduler.fake_worker import FakeWorker
from scheduler.loop import StepLoop
from scheduler.policies import make_policy
from scheduler.store import open_store

log = logging.getLogger("specgate.serve")

# flag → settings field; flags left out keep the environment's value or the default
_FLAGS = ("host", "port", "model", "tenants_file", "redis_url", "policy", "drafters", "grpc_port",
          "dtype", "max_batch", "step_profile", "log_level", "fake_worker", "fake_step_ms")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="HTTP port (default 8000)")
    p.add_argument("--model", help="built-in name, HF model directory or .gguf file "
                                   "(default smollm2-135m)")
    p.add_argument("--tenants", dest="tenants_file", help="tenants YAML file (default: one 'dev' "
                   "tenant whose key is printed at start-up)")
    p.add_argument("--redis-url", help="Redis for scheduler state, tenants and rate limits "
                                       "(default: in process memory)")
    p.add_argument("--policy", choices=["laps", "fcfs", "sjf", "las"], help="scheduling policy "
                   "(default laps)")
    p.add_argument("--drafters", help="comma-separated drafter names; the first is the default "
                                      "(default ngram)")
    p.add_argument("--grpc-port", type=int, help="also serve gRPC on this port")
    p.add_argument("--dtype", choices=["float32", "bfloat16"])
    p.add_argument("--max-batch", type=int, help="requests per verification step (default 8)")
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


class PacedFakeWorker(FakeWorker):
    """The fake worker, sleeping `step_s` per step: a stand-in for a real step's cost, so the
    gateway's own overhead can be measured against something."""

    def __init__(self, step_s: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.step_s = step_s

    def step(self, items):
        if self.step_s:
            time.sleep(self.step_s)
        return super().step(items)


@dataclass
class Embedded:
    """Everything one embedded gateway is made of (`start`/`stop` run the step loop's thread)."""
    settings: Settings
    app: Any
    service: GenerationService
    step_loop: StepLoop
    tenants: Any
    limiter: Any
    metrics: GatewayMetrics
    dev_key: str | None = None          # the dev tenant's key, when one was created now
    admin_key: str | None = None        # an admin key generated now (dev set-up only)
    recovered: list[str] = field(default_factory=list)
    thread: Any = None

    def start(self) -> None:
        self.thread = self.step_loop.start()

    def stop(self) -> None:
        self.step_loop.stop()
        self.thread = None
        self.step_loop.store.close()

    def loop_alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()


def scheduler_prefix(settings: Settings) -> str:
    """Where this replica's scheduler keeps its requests (tenants and limits are shared)."""
    return f"{settings.store_prefix}sched:{settings.replica_id}:"


def build_embedded(settings: Settings, *, progress: bool = True, runtime: Any = None,
                   target: tuple | None = None, recover: bool = True) -> Embedded:
    """Everything but the listening: `runtime` (a `workers.runtime.Runtime` already loaded, e.g.
    by a test or a benchmark) is used instead of loading `settings.model`; `target` (tokenizer,
    worker, stop token ids, step-cost model) replaces the model altogether (Ray mode's scheduler
    drives verifier replicas through `gateway.verifier_pool.VerifierPool`). `recover=False` leaves
    recovery from the store to the caller (Ray mode recovers once it holds the scheduler lease)."""
    from gateway.limits import Limiter
    from gateway.tenants import TenantRegistry, new_api_key

    tokenizer, worker, stop_ids, step_cost = target or _target(settings, progress, runtime)
    metrics = GatewayMetrics()
    max_resident = max(settings.max_resident, settings.max_batch)
    # The policy starts a new request only while KV room is left, so the loop never has to evict
    # (evict, re-prefill, fall further behind: the simulator's meltdown under bursts).
    policy = make_policy(settings.policy, max_batch=settings.max_batch,
                         token_budget=settings.token_budget, max_nodes=settings.max_tree_nodes,
                         step_cost=step_cost, max_resident=max_resident)
    admission = AdmissionControl(AdmissionLimits(
        max_live=settings.max_live, max_live_per_tenant=settings.max_live_per_tenant,
        per_tenant={}))                               # filled per tenant by the service
    store = open_store(settings.redis_url, scheduler_prefix(settings), ended_ttl_s=settings.ended_ttl_s)
    step_loop = StepLoop(policy, metrics.instrument(worker), store, admission=admission,
                         max_resident=max_resident)
    recovered = step_loop.recover() if recover else []
    if settings.tenants_file is not None:
        tenants = TenantRegistry.from_file(settings.tenants_file, settings.redis_url,
                                           settings.store_prefix)
    else:
        tenants = TenantRegistry(settings.redis_url, settings.store_prefix)
    dev_key = tenants.ensure_dev_tenant()
    admin_key = None
    if settings.admin_key is not None:
        tenants.add_admin_key(settings.admin_key.get_secret_value())
    elif dev_key is not None:                         # a fresh dev set-up: an admin key too
        admin_key = new_api_key()
        tenants.add_admin_key(admin_key)
    limiter = Limiter(settings.redis_url, settings.store_prefix)
    emb = Embedded(settings, None, None, step_loop, tenants, limiter, metrics, dev_key, admin_key,
                   recovered)
    checks: list[Callable[[], bool]] = [emb.loop_alive]
    components: dict[str, Callable[[], bool]] = {"step_loop": emb.loop_alive}
    if settings.redis_url:
        from gateway.tenants import connect_store
        checks.append(connect_store(settings.redis_url).ping)     # the store answers
        components["state_store"] = checks[-1]
    metrics.watch(step_loop, components)
    emb.service = GenerationService(step_loop, tokenizer, models=[settings.model_id],
                                    limiter=limiter, metrics=metrics, stop_token_ids=stop_ids,
                                    drafters=settings.drafter_names, ready_checks=checks)
    emb.app = build_app(settings, emb.service, tenants, limiter, metrics)
    return emb


def _target(settings: Settings, progress: bool, runtime: Any = None):
    """(tokenizer, worker, stop token ids, policy step-cost model) for the settings."""
    from workers.drafters.registry import drafter_names, is_drafter_name

    unknown = [d for d in settings.drafter_names if not is_drafter_name(d)]
    if unknown:
        raise ValueError(f"unknown drafter {unknown[0]!r}; available: {', '.join(drafter_names())}")
    if settings.fake_worker:
        tok = ToyTokenizer()
        worker = PacedFakeWorker(settings.fake_step_ms / 1000, context_limit=settings.fake_context)
        return tok, worker, {tok.eos_token_id}, None
    from workers.runtime import load_runtime

    rt = runtime or load_runtime(settings.model, dtype=settings.dtype, progress=progress)
    return rt.tokenizer, batch_worker(settings, rt), rt.stop_token_ids, planner_step_cost(settings, rt)


def planner_step_cost(settings: Settings, rt: Any, measured: dict | None = None) -> Any:
    """The step costs the planner sizes tree budgets by: `settings.step_profile` when set, else
    `measured` (a verifier replica's start-up profile, Ray mode), else measured now on `rt`."""
    from scheduler.bench_profile import startup_profile
    from scheduler.profile import StepCostModel

    if settings.step_profile is not None:
        return StepCostModel.from_json(settings.step_profile)
    if measured is None:
        measured = startup_profile(rt, settings.max_batch)
    return StepCostModel.from_doc(measured)


def batch_worker(settings: Settings, rt: Any, drafters: dict | None = None) -> Any:
    """The model worker for a loaded runtime: in process (embedded) or in a verifier replica (Ray,
    where `drafters` are the draft workers' remote drafters by name)."""
    from workers.batch_worker import BatchWorker

    return BatchWorker(rt.verifier(max_tree_nodes=max(64, settings.max_tree_nodes),
                                   prefix_cache_mb=settings.prefix_cache_mb),
                       default_drafter=settings.drafter_names[0],
                       speculation=rt.speculation_config(), drafters=drafters)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "ray", False):
        from gateway import ray_cmd
        given = {k: getattr(args, k) for k in _FLAGS if getattr(args, k, None) is not None}
        return ray_cmd.run(args, {k: str(v) if isinstance(v, Path) else v for k, v in given.items()})
    settings = settings_from_args(args)
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    emb = build_embedded(settings)
    if emb.recovered:
        log.info("recovered %d request(s) from the state store", len(emb.recovered))
    if emb.dev_key:
        print(f"specgate: dev tenant API key: {emb.dev_key}", file=sys.stderr)
    if emb.admin_key:
        print(f"specgate: admin key (/metrics, /admin): {emb.admin_key}", file=sys.stderr)
    import uvicorn

    config = uvicorn_config(emb.app, host=settings.host, port=settings.port,
                            log_level=settings.log_level)
    emb.start()
    try:
        _run_on(config.get_loop_factory(), _serve(emb, uvicorn.Server(config)))
    finally:
        emb.stop()
    return 0


# How long an idle keep-alive connection stays open. uvicorn's default, 5 s, is also httpx's
# keepalive_expiry: a client may then send its next request on a pooled connection at the instant
# the server closes it, and see a ReadError for a request the server never read (one in 657 in a
# `loadtest compare` run on a busy 2-core machine). Longer than clients keep idle connections,
# the client always closes first; 90 s is what Ray Serve's proxy keeps (Ray mode).
KEEP_ALIVE_S = 90


def uvicorn_config(app: Any, **options: Any) -> Any:
    """The uvicorn.Config every specgate HTTP server runs with (`options`: host, port, …)."""
    import uvicorn

    return uvicorn.Config(app, lifespan="off", timeout_keep_alive=KEEP_ALIVE_S, **options)


def _run_on(loop_factory: Callable[[], asyncio.AbstractEventLoop] | None, main: Any) -> None:
    """`asyncio.run(main)` on uvicorn's choice of event loop ("auto": uvloop when installed), the
    one `uvicorn.run` and `background_server` use; gRPC shares it. Python 3.10 has no
    `asyncio.Runner`: the default loop there."""
    if loop_factory is None or not hasattr(asyncio, "Runner"):
        asyncio.run(main)
        return
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(main)


async def _serve(emb: Embedded, server: Any) -> None:
    s = emb.settings
    grpc = None
    if s.grpc_port is not None:
        from gateway.grpc_server import start_grpc_server
        grpc = await start_grpc_server(emb.service, emb.tenants, emb.limiter, s.grpc_port,
                                       host=s.host)
    print(f"specgate: serving {s.model_id} on http://{s.host}:{s.port}"
          + (f" and gRPC {s.host}:{grpc.port}" if grpc else "")
          + f" (policy {s.policy}, drafters {s.drafters})", file=sys.stderr)
    try:
        await server.serve()
    finally:
        if grpc is not None:
            await grpc.stop()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (for servers that take a port number, not a socket:
    Ray Serve's proxy, Prometheus)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def background_server(app: Any, host: str = "127.0.0.1", port: int = 0,
                      log_level: str = "warning") -> Iterator[str]:
    """Serve `app` with uvicorn on a daemon thread (tests, gateway benchmarks); yields the base
    URL ("http://127.0.0.1:PORT"); stops the server on exit. Port 0: a free port."""
    import uvicorn

    # IPPROTO_TCP given explicitly: asyncio sets TCP_NODELAY only on sockets that say so (with
    # proto 0 every response would wait ~40 ms for a delayed ACK: Nagle).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    server = uvicorn.Server(uvicorn_config(app, log_level=log_level))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]},
                              name="specgate-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the HTTP server did not start")
        time.sleep(0.01)
    try:
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
