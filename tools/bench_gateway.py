"""`specgate bench gateway`: what the HTTP gateway adds over calling the step loop directly.

One run, one embedded gateway (`gateway.builders.embedded.build_embedded`) over the fake worker: no model, a step
costs `--step-ms` of sleep (0 by default), so what is measured is the serving path itself.

    direct      a short request submitted straight to the gateway's own `StepLoop`, timed until
                its `Finished` event: the floor (thread hand-offs, admission, steps, the store);
    gateway     the same request (same prompt ids, max_tokens, tenant, drafter) as a
                non-streaming POST /v1/completions over loopback HTTP/1.1 keep-alive: auth, body
                parsing, validation, limits, tokenizing, the event bridge, the JSON response.
                One request at a time, direct and gateway alternating, so machine noise hits both
                alike. Added latency = median(gateway) − median(direct) (p90 and p99 likewise);
    throughput  `concurrency` keep-alive connections, each sending its next request as soon as
                its answer arrives, `throughput_requests` in all: requests/s (200s only). The
                step loop's own rate at the same concurrency (`direct_requests_per_s`) is the
                ceiling the gateway is held against.

Where things run, on 2 cores. The gateway is one Python process however it is deployed: its event
loop and its step loop's thread share one GIL, so it uses about one core. A client in the same
process competes with the server for that GIL (each request it sends and parses is time the server
cannot run); a client in another process competes only for the other core, which the server could
not use anyway. So the headline figures (`--server process`) have the gateway in a child process
and the clients here; the direct requests are timed inside that child, on the very step loop the
HTTP requests reach. `--server thread` serves from threads of this process instead (the tests'
`background_server` set-up); `--server both` (the default) reports it too, under "same_process".
NOTE: on the 2-core development machine the same-process figures came out a little better, not
worse; they stay the second figures because real clients never share the gateway's process.

The clients are lean so that they are never the bottleneck: prebuilt request bytes, a raw socket,
Content-Length framing. `client_cpu_share` and `server_cpu_share` are the CPU time each process
used over the wall time of the throughput phase (in the thread placement both are this process's).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import math
import multiprocessing
import os
import platform
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from loadtest.compare import recv_or_none
from loadtest.http_client import HttpClient, completion_request, load
from loadtest.results import write_result

if TYPE_CHECKING:
    from gateway.assembly.serving import Embedded

TARGETS = {"added_latency_ms_median": 1.0, "requests_per_s": 1000.0}
DEFAULT_PROMPT = "Say hello in one word."
PLACEMENTS = ("process", "thread", "both")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=1000,
                   help="sequential requests per path (direct, gateway) for the latencies")
    p.add_argument("--throughput-requests", type=int, default=10000,
                   help="requests in the throughput phase")
    p.add_argument("--concurrency", type=int, default=64,
                   help="requests in flight (keep-alive connections) in the throughput phase")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--step-ms", type=float, default=0.0, help="fake worker sleep per step")
    p.add_argument("--max-batch", type=int, default=8, help="requests per step")
    p.add_argument("--policy", choices=["laps", "fcfs", "sjf", "las"], default="laps")
    p.add_argument("--server", choices=PLACEMENTS, default="both",
                   help="the gateway in a child process, on threads of this one, or both (the "
                        "child process's figures are the headline ones)")
    p.add_argument("--json", type=Path, help="write the results here")


def run(args: argparse.Namespace) -> int:
    report = bench_gateway(requests=args.requests, throughput_requests=args.throughput_requests,
                           concurrency=args.concurrency, max_tokens=args.max_tokens,
                           prompt=args.prompt, step_ms=args.step_ms, max_batch=args.max_batch,
                           policy=args.policy, server=args.server, progress=True)
    print(summary(report), file=sys.stderr)
    text = json.dumps(report, indent=1)
    if args.json:
        write_result(args.json, report)
    print(text)
    return 0


def bench_gateway(*, requests: int = 1000, throughput_requests: int = 10000,
                  concurrency: int = 64, max_tokens: int = 4, prompt: str = DEFAULT_PROMPT,
                  step_ms: float = 0.0, max_batch: int = 8, policy: str = "laps",
                  server: str = "both", warmup: int = 50, progress: bool = False) -> dict:
    """The report (see the module docstring); `server` is one of PLACEMENTS."""
    if server not in PLACEMENTS:
        raise ValueError(f"server must be one of {', '.join(PLACEMENTS)}, got {server!r}")
    if min(requests, throughput_requests, concurrency, max_tokens) < 1:
        raise ValueError("requests, throughput requests, concurrency and max_tokens must be >= 1")
    # Explicit: no Redis, no tenants file (the environment must not point a benchmark at a store).
    settings = dict(fake_worker=True, fake_step_ms=step_ms, max_batch=max_batch, policy=policy,
                    redis_url=None, tenants_file=None, log_level="warning")
    placements = ("process", "thread") if server == "both" else (server,)
    results = {}
    for placement in placements:
        if progress:
            print(f"bench gateway: the gateway in a {placement} …", file=sys.stderr)
        start = _in_child if placement == "process" else serving
        with start(settings, prompt, max_tokens) as gw:
            results[placement] = _measure(gw, requests, throughput_requests, concurrency,
                                          prompt, max_tokens, warmup)
    head = results[placements[0]]
    report = {
        "benchmark": "gateway", "server": placements[0], "requests": requests,
        "throughput_requests": throughput_requests, "concurrency": concurrency,
        "max_tokens": max_tokens, "prompt": prompt, "warmup": warmup, "fake_step_ms": step_ms,
        "max_batch": max_batch, "policy": policy, "endpoint": "/v1/completions",
        "client": "raw socket, HTTP/1.1 keep-alive", **_environment(), **head,
        "targets": TARGETS,
        "targets_met": {
            "added_latency_ms_median": head["added_latency_ms_median"]
            <= TARGETS["added_latency_ms_median"],
            "requests_per_s": head["requests_per_s"] >= TARGETS["requests_per_s"]},
    }
    if len(placements) > 1:
        report["same_process"] = results["thread"]
    return report


def summary(r: dict) -> str:
    met = lambda key: "met" if r["targets_met"][key] else "NOT met"   # noqa: E731
    lines = [
        f"bench gateway: the gateway in a {r['server']} ({r['uvicorn_http']}, {r['uvicorn_loop']})"
        f"; {r['requests']} sequential requests a path, max_tokens {r['max_tokens']}",
        f"  direct   median {r['direct_latency_ms_median']:.3f} ms, "
        f"p99 {r['direct_latency_ms_p99']:.3f} ms",
        f"  gateway  median {r['gateway_latency_ms_median']:.3f} ms, "
        f"p99 {r['gateway_latency_ms_p99']:.3f} ms",
        f"  added    median {r['added_latency_ms_median']:.3f} ms, "
        f"p99 {r['added_latency_ms_p99']:.3f} ms   (target <= 1 ms median: "
        f"{met('added_latency_ms_median')})",
        f"  throughput {r['requests_per_s']:.0f} requests/s at {r['concurrency']} in flight "
        f"(target >= 1000: {met('requests_per_s')}), errors {r['errors']}; the step loop alone "
        f"{r['direct_requests_per_s']:.0f}/s",
        f"    under load: median {r['throughput_latency_ms_median']:.1f} ms, p99 "
        f"{r['throughput_latency_ms_p99']:.1f} ms; CPU {r['server_cpu_share']:.2f} of a core "
        f"(server), {r['client_cpu_share']:.2f} (client)",
    ]
    if "same_process" in r:
        s = r["same_process"]
        lines.append(f"  same process (client on the server's GIL): added median "
                     f"{s['added_latency_ms_median']:.3f} ms, {s['requests_per_s']:.0f} "
                     f"requests/s")
    return "\n".join(lines)


# ---- the measurements ---------------------------------------------------------------------------------
def _measure(gw: Target | _Remote, requests: int, throughput_requests: int, concurrency: int, prompt: str,
             max_tokens: int, warmup: int) -> dict:
    raw = completion_request(gw.host, gw.key, gw.model, prompt, max_tokens)
    client = HttpClient(gw.host, gw.port)
    try:
        body = json.loads(client.post(raw))           # a wrong set-up fails here, loudly
        if body["usage"]["completion_tokens"] < 1:
            raise RuntimeError(f"an empty completion: {body}")
        for _ in range(warmup):                         # first calls pay imports, allocations
            gw.direct()
            client.post(raw)
        direct, gateway = [], []
        for _ in range(requests):
            direct.append(gw.direct())
            t0 = time.perf_counter()
            client.post(raw)
            gateway.append(time.perf_counter() - t0)
    finally:
        client.close()
    out = {}
    for q in ("median", "p90", "p99"):
        d, g = 1000 * quantile(direct, q), 1000 * quantile(gateway, q)
        out |= {f"direct_latency_ms_{q}": round(d, 4), f"gateway_latency_ms_{q}": round(g, 4),
                f"added_latency_ms_{q}": round(g - d, 4)}
    server_cpu0, client_cpu0 = gw.cpu_s(), time.process_time()
    ok, errors, latencies, elapsed = asyncio.run(load(gw.host, gw.port, raw, throughput_requests,
                                                      concurrency))
    server_cpu, client_cpu = gw.cpu_s() - server_cpu0, time.process_time() - client_cpu0
    return out | {
        "requests_per_s": round(ok / elapsed, 1), "errors": errors,
        "throughput_seconds": round(elapsed, 3),
        "throughput_latency_ms_median": round(1000 * quantile(latencies, "median"), 3),
        "throughput_latency_ms_p99": round(1000 * quantile(latencies, "p99"), 3),
        "server_cpu_share": round(server_cpu / elapsed, 3),
        "client_cpu_share": round(client_cpu / elapsed, 3),
        "direct_requests_per_s": round(gw.direct_load(throughput_requests, concurrency), 1),
    }


def quantile(xs: list[float], q: str) -> float:
    """Nearest rank: "median", "p90", "p99". quantile([4, 1, 3, 2], "median") == 2."""
    s = sorted(xs)
    frac = 0.5 if q == "median" else int(q[1:]) / 100
    return s[max(0, math.ceil(frac * len(s)) - 1)]


def _environment() -> dict:
    has = lambda name: importlib.util.find_spec(name) is not None   # noqa: E731
    return {"python": platform.python_version(), "cpus": os.cpu_count(),
            # what uvicorn's "auto" picks (background_server and `specgate serve` keep "auto")
            "uvicorn_http": "httptools" if has("httptools") else "h11",
            "uvicorn_loop": "uvloop" if has("uvloop") else "asyncio"}


# ---- the gateway under test ---------------------------------------------------------------------------
class Target:
    """A running embedded gateway (`address`: host, port, the dev key, the model id) and its
    direct path: requests straight into its step loop, built as the service builds them for the
    same body and tenant (prompt ids, sampling, stop ids, drafter, tree cap)."""

    def __init__(self, emb: Embedded, url: str, prompt: str, max_tokens: int) -> None:
        from workers.prompts import encode_record
        host, port = url.removeprefix("http://").split(":")
        self.host, self.port, self.key, self.model = host, int(port), emb.dev_key, emb.settings.model_id
        self.loop = emb.step_loop
        self.tenant = emb.tenants.authenticate(emb.dev_key)
        self.ids = encode_record(emb.service.tokenizer, {"prompt": prompt})
        self.max_tokens, self.stop_ids = max_tokens, emb.service.stop_token_ids
        spec = self.tenant.speculation
        self.drafter = next((d for d in spec.drafters if d in emb.service.drafters), "none")
        self.max_tree_tokens = spec.max_tree_tokens if self.drafter != "none" else 0

    @property
    def address(self) -> tuple[str, int, str, str]:
        return self.host, self.port, self.key, self.model

    def direct(self) -> float:
        """One direct request: seconds from submit to its Finished event."""
        done = threading.Event()
        t0 = time.perf_counter()
        self._submit(lambda ev: done.set() if _finished(ev) else None)
        if not done.wait(30):
            raise RuntimeError("a direct request did not finish within 30 s")
        return time.perf_counter() - t0

    def direct_load(self, total: int, concurrency: int) -> float:
        """The step loop's own requests/s: `concurrency` direct requests in flight, each replaced
        as it finishes (from its sink, on the loop's thread), `total` in all."""
        done, count = threading.Event(), {"sent": 0, "finished": 0}

        def sink(ev: Any) -> None:
            if _finished(ev):
                count["finished"] += 1
                if count["finished"] == total:
                    done.set()
                elif count["sent"] < total:
                    count["sent"] += 1
                    self._submit(sink)

        t0 = time.perf_counter()
        for _ in range(min(total, concurrency)):
            count["sent"] += 1
            self._submit(sink)
        if not done.wait(60 + total / 100):
            raise RuntimeError("the direct load did not finish in time")
        return total / (time.perf_counter() - t0)

    def cpu_s(self) -> float:
        return time.process_time()

    def _submit(self, sink: Callable[[Any], None]) -> None:
        from scheduler.admission import ADMITTED
        from scheduler.request import Request, RequestStats
        from workers.contract import SamplingParams

        stats = RequestStats(f"direct-{uuid.uuid4().hex}", self.tenant.name, self.loop.clock(),
                             prompt_len=len(self.ids), max_tokens=self.max_tokens,
                             priority=self.tenant.priority, max_tree_tokens=self.max_tree_tokens)
        req = Request(stats, prompt_ids=list(self.ids), sampling=SamplingParams(),
                      stop_token_ids=self.stop_ids, drafter=self.drafter)
        if self.loop.submit(req, sink) is not ADMITTED:
            raise RuntimeError("the step loop refused a direct request (queue full)")


def _finished(event: Any) -> bool:
    from scheduler.loop import Finished
    return isinstance(event, Finished)


@contextlib.contextmanager
def serving(settings: dict, prompt: str, max_tokens: int) -> Iterator[Target]:
    """The embedded gateway over `Settings(**settings)`, serving HTTP from threads of this
    process (`background_server`), until the block ends."""
    from gateway.http.server import background_server
    from gateway.builders.embedded import build_embedded
    from gateway.settings import Settings

    emb = build_embedded(Settings(**settings), progress=False)
    emb.start()
    try:
        with background_server(emb.app) as url:
            yield Target(emb, url, prompt, max_tokens)
    finally:
        emb.stop()


class _Remote:
    """A `Target` in a child process, asked over a pipe."""

    def __init__(self, conn: Any, child: Any) -> None:
        self.conn, self.child = conn, child
        self.host, self.port, self.key, self.model = self._reply()

    def direct(self) -> float:
        return self._ask("direct")

    def direct_load(self, total: int, concurrency: int) -> float:
        return self._ask("direct_load", total, concurrency)

    def cpu_s(self) -> float:
        return self._ask("cpu_s")

    def _ask(self, *msg: Any) -> Any:
        self.conn.send(msg)
        return self._reply()

    def _reply(self) -> Any:
        try:
            answer = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"the gateway process died (exit code {self.child.exitcode}); "
                               "its traceback is above") from None
        if isinstance(answer, BaseException):
            raise answer
        return answer


@contextlib.contextmanager
def _in_child(settings: dict, prompt: str, max_tokens: int) -> Iterator[_Remote]:
    ctx = multiprocessing.get_context("spawn")        # never fork a process that holds threads
    here, there = ctx.Pipe()
    child = ctx.Process(target=_child_main, args=(settings, prompt, max_tokens, there),
                        name="specgate-bench-gateway", daemon=True)
    child.start()
    there.close()
    try:
        if not here.poll(120):
            raise RuntimeError("the gateway process did not start within 120 s")
        yield _Remote(here, child)
    finally:
        with contextlib.suppress(OSError):
            here.send(("stop",))
        child.join(15)
        if child.is_alive():
            child.terminate()
            child.join(5)
        here.close()


def _child_main(settings: dict, prompt: str, max_tokens: int, conn: Any) -> None:
    """The gateway process: `serving`, then answer the pipe ("direct", "direct_load", "cpu_s")
    until "stop" or until the parent is gone. Errors go back as exceptions."""
    try:
        with serving(settings, prompt, max_tokens) as target:
            calls = {"direct": target.direct, "direct_load": target.direct_load, "cpu_s": target.cpu_s}
            conn.send(target.address)
            while (msg := recv_or_none(conn)) is not None and msg[0] != "stop":
                try:
                    if msg[0] not in calls:
                        raise ValueError(f"unknown call {msg[0]!r}")
                    conn.send(calls[msg[0]](*msg[1:]))
                except Exception as exc:
                    conn.send(RuntimeError(f"{msg[0]} failed in the gateway process: {exc!r}"))
    except Exception as exc:
        with contextlib.suppress(OSError):
            conn.send(RuntimeError(f"the gateway process failed: {exc!r}"))
